"""`vf-rl export CHECKPOINT OUT [--merge | --adapter] [--base MODEL] [--force]`: any checkpoint as a folder to
serve, evaluate and share, laid out like a run's `final/` (verifiers_rl.export.writer).

    --merge     only the merged model (LoRA merged into the base weights)
    --adapter   only the LoRA adapter (peft), for the base model it was trained on
    (neither)   both: the merged model, with the adapter in OUT/adapter (a fully fine-tuned checkpoint: the model)
    --base      the base model of a LoRA checkpoint, when the one it records has moved
    --force     replace OUT when it exists
"""

from __future__ import annotations

from pathlib import Path

from verifiers_rl.errors import ConfigError
from verifiers_rl.scripts.common import run_cli

USAGE = "usage: vf-rl export CHECKPOINT OUT [--merge | --adapter] [--base MODEL] [--force]"


def parse(argv: list[str]) -> dict:
    opts = {"merge": False, "adapter": False, "force": False, "base": None}
    paths: list[str] = []
    args = iter(argv)
    for a in args:
        if a in ("--merge", "--adapter", "--force"):
            opts[a[2:]] = True
        elif a == "--base" or a.startswith("--base="):
            opts["base"] = a.split("=", 1)[1] if "=" in a else next(args, None)
            if not opts["base"]:
                raise ConfigError("--base needs the base model (a hub id or a local folder)")
        elif a.startswith("-"):
            raise ConfigError(f"unknown option {a!r}; {USAGE}")
        else:
            paths.append(a)
    if len(paths) != 2:
        raise ConfigError(USAGE)
    if opts["merge"] and opts["adapter"]:
        raise ConfigError("--merge and --adapter exclude each other (neither writes both)")
    opts["checkpoint"], opts["out"] = paths
    return opts


def _check_out(out: Path, checkpoint: Path, force: bool) -> None:
    if out.resolve() == checkpoint.resolve() or checkpoint.resolve() in out.resolve().parents:
        raise ConfigError(f"OUT {str(out)!r} is inside the checkpoint: write the export somewhere else")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"OUT {str(out)!r} is a file")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ConfigError(f"OUT {str(out)!r} exists and is not empty: pass --force to replace it")


def export_checkpoint(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(__doc__.strip())
        return 0
    opts = parse(argv)
    checkpoint, out = Path(opts["checkpoint"]), Path(opts["out"])
    if not checkpoint.is_dir():
        raise ConfigError(f"CHECKPOINT {str(checkpoint)!r} is not a folder")
    _check_out(out, checkpoint, opts["force"])
    from verifiers_rl.export.card import ModelCard
    from verifiers_rl.export.sources import layout, open_checkpoint
    from verifiers_rl.export.writer import export_model, is_lora

    if opts["adapter"] and layout(checkpoint) == "full":
        raise ConfigError(f"--adapter needs a LoRA checkpoint; {checkpoint} holds full model weights")
    source = open_checkpoint(checkpoint, base=opts["base"])
    lora = is_lora(source.model)
    kind = "adapter" if opts["adapter"] else "merged" if opts["merge"] or not lora else "merged+adapter"
    info = {**source.run_info, "step": source.step, "exported_from": str(checkpoint.resolve())}
    if lora and opts["base"]:
        info["base_model"], info["base_model_path"] = opts["base"], None
    card = ModelCard.from_run(  # the run's folder holds its checkpoints
        info,
        run_dir=checkpoint.parent,
        step=source.step,
        kind=kind,
        log_history=source.log_history,
        title=checkpoint.name,
    )
    export_model(source.model, source.tokenizer, out, kind=kind, card=card, run_info=info)
    what = {
        "adapter": "the LoRA adapter",
        "merged": "the merged model",
        "merged+adapter": "the merged model + adapter/",
    }
    serve = "" if kind == "adapter" else f"; serve it: vf-vllm --model {out}"
    print(f"vf-rl export: wrote {what[kind]} of {checkpoint} (step {source.step}) to {out}{serve}", flush=True)
    return 0


def run_export(argv: list[str]) -> int:
    return run_cli("vf-rl export", lambda: export_checkpoint(argv))
