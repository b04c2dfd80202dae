"""Pieces the commands share: the `@ cfg.toml` argument, model resolution, environments, flags, errors."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verifiers_rl.config.toml import ConfigError, flags_from_args, output_path, resolve_path  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from verifiers_rl.config.run_file import Eval, RunFile

TINY_CACHE = "tiny-models"  # under outputs/


USAGE = {
    "vf-rl": """usage: vf-rl @ CONFIG.toml [--dry-run [--gpus N] [--gpu-memory GIB] [--nodes N]] [--KEY VALUE ...]
       vf-rl setup [DIR] [--force]
       vf-rl export CHECKPOINT OUT [--merge | --adapter] [--base MODEL] [--force]

Train with RL in one command: the inference server (vLLM on GPUs, the CPU engine otherwise) and the trainer,
as CONFIG.toml says (docs/configuration.md lists every key).

  @ CONFIG.toml          the run's config: model, [env], [inference], [trainer], [trainer.args] (RLConfig)
  --dry-run              print the plan (GPUs, memory, the server's and the trainer's commands); start nothing
  --gpus N               with --dry-run: plan for a machine with N GPUs
  --gpu-memory GIB       with --dry-run --gpus: GiB of each of those GPUs (default 80)
  --nodes N              with --dry-run --gpus: the commands of a run over N machines of --gpus GPUs each
  --KEY VALUE            override a config key (SECTION.KEY), e.g. --trainer.args.learning_rate 1e-4
  setup                  lay out a workspace here: configs, environments/AGENTS.md, endpoints (offline)
  export                 a checkpoint as a model to serve and share (merged weights or the LoRA adapter)
  -h, --help             this text""",
    "vf-train": """usage: vf-train @ CONFIG.toml [--dry-run] [--SECTION.KEY VALUE ...]

The trainer alone, against an inference server that already runs (vf-vllm, or the one vf-rl started) at
[inference] host/port (8000 when unset); its control token from $VF_CONTROL_TOKEN.

  --dry-run              say what would be trained against which server; start nothing
  --SECTION.KEY VALUE    override a config key, e.g. --trainer.args.learning_rate 1e-4
  -h, --help             this text""",
    "vf-sft": """usage: vf-sft @ CONFIG.toml [--dry-run] [--SECTION.KEY VALUE ...]

Supervised warm-start (TRL's SFTTrainer, LoRA or full) that writes <output_dir>/final, a model an RL config can
use (`model = ...` or `[sft] config = ...`).

  --dry-run              print the resolved config; train nothing
  --SECTION.KEY VALUE    override a config key, e.g. --trainer.args.learning_rate 1e-4
  -h, --help             this text""",
}


class HelpRequested(Exception):
    """-h / --help anywhere on a command line: print the usage and start nothing."""


def wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def split_argv(argv: list[str], prog: str) -> tuple[str, list[str], set[str]]:
    """`@ cfg.toml --dry-run --trainer.args.x 1` -> (path, overrides, flags)."""
    if wants_help(argv):
        raise HelpRequested(prog)
    if argv and argv[0].startswith("@") and argv[0] != "@":
        argv = ["@", argv[0][1:], *argv[1:]]
    if len(argv) < 2 or argv[0] != "@":
        raise ConfigError(USAGE[prog].splitlines()[0] + f" (see {prog} --help)")
    flags: set[str] = set()
    rest: list[str] = []
    args = iter(argv[2:])
    for a in args:
        if a == "--dry-run":
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


def resolve_model(run: RunFile, dry_run: bool = False) -> str:
    """The model to load: "tiny" builds the offline tiny model once (deterministic) and returns its folder; a
    relative local path ("./x", "../x") is relative to the config file; a hub id is returned as is."""
    model, config_path = run.model, run.path
    if model != "tiny":
        if config_path is not None and model.startswith(("./", "../", "~")):
            path = resolve_path(model, config_path)
            # a config beside the current directory gives "x": keep it a path, or it would be read as a hub id
            return path if os.path.isabs(path) or path.startswith(".") else os.path.join(".", path)
        return model
    spec = run.tiny_spec()
    cache = Path(output_path(None, TINY_CACHE, config_path))  # the config's workspace's outputs/, not the cwd's
    path = cache / f"h{spec.hidden}-l{spec.layers}-d{spec.head_dim}-s{spec.seed}"
    if not dry_run and not (path / "config.json").exists():
        from verifiers_rl.export.checkpoints import staged
        from verifiers_rl.tiny import save_tiny_model

        try:
            with staged(path) as tmp:  # an interrupted build leaves nothing a later run would take as the model
                save_tiny_model(tmp, hidden=spec.hidden, layers=spec.layers, head_dim=spec.head_dim, seed=spec.seed)
        except ValueError as e:
            raise ConfigError(f"[tiny] {e}") from None
    return str(path)


def load_env(run: RunFile):
    from verifiers_rl.scripts.environments import load_environment, load_environments

    if len(run.env) > 1:  # [[env]] tables: one EnvGroup drawn by their ratios
        return load_environments(run.env)
    return load_environment(run.env[0].id, run.env[0].args)


def with_eval_settings(args, ev: Eval):
    """The RLConfig with [eval] num_examples / rollouts_per_example / temperature: a new one, checked again
    (`RLConfig.derive`), or `args` itself when [eval] sets none of them."""
    chosen: dict[str, Any] = {}
    if ev.num_examples:
        chosen["num_eval_examples"] = ev.num_examples
    if ev.rollouts_per_example:
        chosen["eval_rollouts_per_example"] = ev.rollouts_per_example
    if ev.temperature is not None:
        chosen["eval_temperature"] = float(ev.temperature)
    return args.derive(**chosen) if chosen else args


def evaluations(trainer, ev: Eval, when: str) -> dict[str, dict]:
    """evaluate() at the eval temperature as `when`, and with [eval] greedy = true also at temperature 0 as
    `<when>_greedy`: a policy can gain at its sampling temperature only by sharpening, which greedy decoding shows."""
    out = {when: trainer.evaluate(metric_key_prefix=f"eval_{when}")}
    if ev.greedy:
        out[f"{when}_greedy"] = trainer.evaluate(metric_key_prefix=f"eval_{when}_greedy", temperature=0.0)
    return out


def evaluate_base(model: str, env, args, ev: Eval) -> dict[str, dict]:
    """[eval] base = true: the model the [sft] warm-start starts from, evaluated as the RL policy is, on a server
    of its own (started and stopped here, before the run's server), so the warm-start's share shows."""
    from verifiers_rl.trainer import RLTrainer

    args = with_eval_settings(args, ev)
    print(f"vf-rl: evaluating the model before the warm-start ({model})", flush=True)
    trainer = RLTrainer(model=model, env=env, args=args)
    try:
        return evaluations(trainer, ev, "base")
    finally:
        trainer.close()


def train_and_evaluate(model: str, env, args, run: RunFile, server=None, serving=None, base=None) -> int:
    """RLTrainer with the config's [eval] before/after (every process runs it: evaluate() talks to the server on
    the main process only and hands the metrics to the others), resuming from the last checkpoint of output_dir
    unless trainer.args.resume_from_checkpoint = false; the main process writes the report, then <output_dir>/final
    (whose model card shows the evaluations). `server` and `serving`: the server vf-rl started and the plan it
    started it by; `base`: evaluate_base()'s metrics, for the report."""
    from verifiers_rl.export.checkpoints import has_checkpoint
    from verifiers_rl.scripts.report import write_report
    from verifiers_rl.trainer import RLTrainer

    ev = run.eval
    args = with_eval_settings(args, ev)
    resume = True if wants_resume(args) and has_checkpoint(args.output_dir) else None
    trainer = RLTrainer(model=model, env=env, args=args)
    trainer.run_config = run.as_dict()
    trainer.runtime.session.watched = server  # the server vf-rl started: a dead or stuck one is named at once
    if serving is not None:
        trainer.runtime.session.plan = serving  # vf-rl planned that server: the trainer syncs by the same plan
    evals: dict[str, dict | None] = dict(base or {})
    try:
        resume, finished = trainer.settled_resume(resume)
        if finished:
            return 0
        # a resumed run evaluated "before" when it started: those rows are in metrics.jsonl already
        earlier = earlier_evals(args.output_dir, "before") if resume else {}
        evals.update(earlier)
        if ev.before and not earlier:
            evals.update(evaluations(trainer, ev, "before"))
        trainer.train(resume_from_checkpoint=resume, save_final=False)
        if ev.after:
            evals.update(evaluations(trainer, ev, "after"))
    finally:
        trainer.close()
    if trainer.is_world_process_zero():
        write_report(args.output_dir, evals)
    final = trainer.save_final()
    if final and trainer.is_world_process_zero():
        print(f"final model: {final} (serve it: vf-vllm --model {final})", flush=True)
    return 0


def wants_resume(args) -> bool:
    """vf-rl and vf-train resume from output_dir's checkpoints unless resume_from_checkpoint = false."""
    return args.resume_from_checkpoint is not False


def earlier_evals(output_dir: str, when: str) -> dict[str, dict]:
    """The `when` evaluations (and `<when>_greedy`) a run logged into metrics.jsonl before it was stopped, by name,
    as evaluations() returns them."""
    from verifiers_rl.export.reward_curve import read_metrics

    out: dict[str, dict] = {}
    for row in read_metrics(output_dir):
        for name in (when, f"{when}_greedy"):
            prefix = f"eval_{name}/"
            if any(k.startswith(prefix) for k in row):
                out[name] = {k: v for k, v in row.items() if k.startswith(prefix)}
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
        sys.modules.get(m) for m in ("verifiers_rl.serving.client", "verifiers_rl.rollouts.orchestrator")
    )
    return (client is not None and isinstance(e, client.ServerError)) or (
        orchestrator is not None and isinstance(e, orchestrator.GenerationError)
    )


def quiet_start() -> None:
    """What every start printed without saying anything the plan does not: datasets' map bars over a few prompts
    (HF_DATASETS_DISABLE_PROGRESS_BARS=0 brings them back; the processes the command starts inherit it), and
    DeepSpeed's notice that it found no GPU (the plan's `# devices` says which devices the run uses)."""
    import logging

    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    logging.getLogger("DeepSpeed").addFilter(lambda record: "Setting accelerator to CPU" not in record.getMessage())


def run_cli(prog: str, body: Callable[[], int]) -> int:
    """Run a command body; known failures become one line on stderr and a non-zero exit, no traceback."""
    from verifiers_rl.inference.cpu.openmp import bound_openmp_spin

    bound_openmp_spin()  # before torch loads, here and in every process the command starts
    quiet_start()
    try:
        return body()
    except HelpRequested:
        print(USAGE[prog])
        return 0
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
