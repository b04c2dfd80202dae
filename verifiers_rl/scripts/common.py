"""Pieces the commands share: the `@ cfg.toml` argument, model resolution, environments, flags, errors."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verifiers_rl.scripts.toml_config import ConfigError, resolve_path

TINY_CACHE = Path("outputs") / "tiny-models"


def split_argv(argv: list[str], prog: str) -> tuple[str, list[str], set[str]]:
    """`@ cfg.toml --dry-run --trainer.args.x 1` -> (path, overrides, flags)."""
    if argv and argv[0].startswith("@") and argv[0] != "@":
        argv = ["@", argv[0][1:], *argv[1:]]
    if len(argv) < 2 or argv[0] != "@":
        raise ConfigError(f"usage: {prog} @ path/to/config.toml [--dry-run] [--section.key value ...]")
    flags: set[str] = set()
    rest: list[str] = []
    args = iter(argv[2:])
    for a in args:
        if a in ("--dry-run", "--help", "-h"):
            flags.add(a)
        elif a == "--gpus" or a.startswith("--gpus="):  # plan for a machine with N CUDA devices
            value = a.split("=", 1)[1] if "=" in a else next(args, "")
            if not value.isdigit():
                raise ConfigError("--gpus needs a number of CUDA devices")
            flags.add(f"--gpus={value}")
        elif a == "--nodes" or a.startswith("--nodes="):  # plan for N machines of --gpus N each
            value = a.split("=", 1)[1] if "=" in a else next(args, "")
            if not value.isdigit() or int(value) < 1:
                raise ConfigError("--nodes needs a number of machines (>= 1)")
            flags.add(f"--nodes={value}")
        elif a == "--gpu-memory" or a.startswith("--gpu-memory="):  # GiB per GPU of that machine
            value = a.split("=", 1)[1] if "=" in a else next(args, "")
            try:
                flags.add(f"--gpu-memory={float(value)}")
            except ValueError:
                raise ConfigError("--gpu-memory needs the GiB of one GPU, e.g. --gpu-memory 80") from None
        else:
            rest.append(a)
    return argv[1], rest, flags


def resolve_model(cfg: dict[str, Any], config_path: str | Path | None = None, dry_run: bool = False) -> str:
    """The model to load: "tiny" builds the offline tiny model once (deterministic) and returns its folder; a
    relative local path ("./x", "../x") is relative to the config file; a hub id is returned as is."""
    model = cfg["model"]
    if model != "tiny":
        if config_path is not None and model.startswith(("./", "../", "~")):
            path = resolve_path(model, config_path)
            # a config beside the current directory gives "x": keep it a path, or it would be read as a hub id
            return path if os.path.isabs(path) or path.startswith(".") else os.path.join(".", path)
        return model
    spec = {"hidden": 64, "layers": 2, "seed": 0, "head_dim": 32, **cfg.get("tiny", {})}
    path = TINY_CACHE / f"h{spec['hidden']}-l{spec['layers']}-d{spec['head_dim']}-s{spec['seed']}"
    if not dry_run and not (path / "config.json").exists():
        from verifiers_rl.tiny import save_tiny_model

        try:
            save_tiny_model(path, **spec)
        except ValueError as e:
            raise ConfigError(f"[tiny] {e}") from None
    return str(path)


def load_env(cfg: dict[str, Any]):
    from verifiers_rl.scripts.environments import load_environment

    return load_environment(cfg["env"]["id"], cfg["env"].get("args", {}))


def train_and_evaluate(model: str, env, args, cfg: dict[str, Any], server=None, serving=None) -> int:
    """RLTrainer with the config's [eval] before/after (every process runs it: evaluate() talks to the server on
    the main process only and hands the metrics to the others), resuming from the last checkpoint of output_dir
    unless trainer.args.resume_from_checkpoint = false; the main process writes the report, then <output_dir>/final
    (whose model card shows both evaluations). `server` and `serving`: the server vf-rl started and the plan it
    started it by."""
    from verifiers_rl.rl.trainer import RLTrainer
    from verifiers_rl.rl.trainer.checkpoints import has_checkpoint
    from verifiers_rl.scripts.report import write_report

    ev = cfg.get("eval", {})
    if ev.get("num_examples"):
        args.num_eval_examples = ev["num_examples"]
    if ev.get("rollouts_per_example"):
        args.eval_rollouts_per_example = ev["rollouts_per_example"]
    resume = None
    if cfg.get("trainer", {}).get("args", {}).get("resume_from_checkpoint") is not False:
        if has_checkpoint(args.output_dir):
            resume = True
    trainer = RLTrainer(model=model, env=env, args=args)
    trainer.run_config = cfg
    trainer.runtime.session.watched = server  # the server vf-rl started: a dead or stuck one is named at once
    if serving is not None:
        trainer.runtime.session.plan = serving  # vf-rl planned that server: the trainer syncs by the same plan
    try:
        before = trainer.evaluate(metric_key_prefix="eval_before") if ev.get("before", False) else None
        trainer.train(resume_from_checkpoint=resume, save_final=False)
        after = trainer.evaluate(metric_key_prefix="eval_after") if ev.get("after", False) else None
    finally:
        trainer.close()
    if trainer.is_world_process_zero():
        write_report(args.output_dir, before, after)
    final = trainer.save_final()
    if final and trainer.is_world_process_zero():
        print(f"final model: {final} (serve it: vf-vllm --model {final})", flush=True)
    return 0


def flags_from_args(args: dict[str, Any]) -> list[str]:
    """[inference.args] -> command-line flags: {enforce_eager = true, max_model_len = 4096} ->
    --enforce-eager --max-model-len 4096 (false drops the flag; lists repeat the value)."""
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            out += [flag, *[str(v) for v in value]]
        elif isinstance(value, dict):
            import json

            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def _actionable(e: Exception) -> bool:
    """Errors whose message is the whole story. Their classes are looked up lazily: importing them up front would
    import torch before a config typo could be reported."""
    if isinstance(e, (FileNotFoundError, NotADirectoryError, OSError)):
        return True
    from verifiers_rl.errors import TrainingError

    if isinstance(e, TrainingError):
        return True
    client, orchestrator = (
        sys.modules.get(m) for m in ("verifiers_rl.rl.inference.client", "verifiers_rl.rl.trainer.orchestrator")
    )
    return (client is not None and isinstance(e, client.ServerError)) or (
        orchestrator is not None and isinstance(e, orchestrator.GenerationError)
    )


def run_cli(prog: str, body: Callable[[], int]) -> int:
    """Run a command body; known failures become one line on stderr and a non-zero exit, no traceback."""
    try:
        return body()
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - re-raised unless it is one of the errors a user acts on
        if not _actionable(e):
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
