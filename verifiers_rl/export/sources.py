"""A checkpoint folder opened as a model to export: a LoRA adapter on its base model, or full weights.

What a checkpoint holds is read from its files (`layout`):

- "adapter": adapter_config.json + adapter_model.safetensors (the trainer's LoRA checkpoints). The base model is
  `--base`, else the one the run recorded (vf_rl_run.json), else peft's base_model_name_or_path.
- "full": config.json + model*.safetensors (full fine-tuning, `final/` folders, any saved model).
- "deepspeed" / "dcp": sharded states (DeepSpeed ZeRO `global_step*/` shards; torch.distributed.checkpoint
  `*.distcp` files, as FSDP writes them) with no consolidated weights beside them. Those are refused with the way
  out: consolidating them is a loader that returns the same `Checkpoint` (the export after it is unchanged).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verifiers_rl.errors import ConfigError
from verifiers_rl.export.card import RUN_INFO

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


@dataclass
class Checkpoint:
    model: Any  # a transformers model, or a peft model (LoRA on its base)
    tokenizer: Any
    step: int = 0
    log_history: list[dict] = field(default_factory=list)
    run_info: dict = field(default_factory=dict)


def _adapter_has_tensors(folder: Path) -> bool:
    path = folder / "adapter_model.safetensors"
    if not path.exists():
        return (folder / "adapter_model.bin").exists()
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:  # ZeRO-3 without gathering saves an empty placeholder
        return bool(list(f.keys()))


def layout(folder: str | os.PathLike) -> str:
    """What the folder holds: "adapter", "full", "deepspeed", "dcp", or "" (no model)."""
    folder = Path(folder)
    if (folder / "adapter_config.json").exists() and _adapter_has_tensors(folder):
        return "adapter"
    if (folder / "config.json").exists() and any((folder / name).exists() for name in WEIGHT_FILES):
        return "full"
    if any(folder.glob("global_step*/*model_states.pt")):
        return "deepspeed"
    if any(folder.glob("*.distcp")) or any(folder.glob("*/*.distcp")):
        return "dcp"
    return ""


def _refuse(folder: Path, kind: str) -> ConfigError:
    if kind == "deepspeed":
        return ConfigError(
            f"{folder} holds sharded DeepSpeed ZeRO states (global_step*/) and no consolidated weights: export cannot "
            "consolidate them yet; train with stage3_gather_16bit_weights_on_model_save=true (checkpoints then hold "
            f"whole weights too), or consolidate with DeepSpeed's `python {folder}/zero_to_fp32.py` first"
        )
    if kind == "dcp":
        return ConfigError(
            f"{folder} holds a sharded torch.distributed.checkpoint (FSDP, *.distcp) and no consolidated weights: "
            "export cannot consolidate it yet; save full state dicts (fsdp_config state_dict_type=FULL_STATE_DICT), "
            "or consolidate with torch.distributed.checkpoint.format_utils.dcp_to_torch_save first"
        )
    from verifiers_rl.export.checkpoints import checkpoints

    inside = [p.name for p in checkpoints(folder)] + ["final"] * (folder / "final").is_dir()
    if inside:  # a run's output folder
        return ConfigError(f"{folder} is a run's output folder: export one of its {', '.join(inside)} folders")
    return ConfigError(
        f"{folder} holds no model: expected a LoRA checkpoint (adapter_config.json + adapter_model.safetensors) or "
        "full weights (config.json + model.safetensors)"
    )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _load(loader, name: str, what: str, **kwargs):
    try:
        return loader.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"cannot load {what} {name!r}: {first}") from None


def _base_model(folder: Path, base: str | None, info: dict) -> str:
    """The adapter's base model: what the user names, else the local folder the run recorded, else peft's record."""
    if base:
        return base
    recorded = info.get("base_model_path")
    if recorded and Path(recorded).is_dir():
        return recorded
    named = _read_json(folder / "adapter_config.json").get("base_model_name_or_path") or info.get("base_model")
    if not named:
        raise ConfigError(f"{folder}/adapter_config.json names no base model: pass --base MODEL")
    if not Path(named).exists() and named.startswith((".", "/", "~")):
        raise ConfigError(f"the base model of {folder}, {named!r}, does not exist (from here): pass --base MODEL")
    return named


def open_checkpoint(folder: str | os.PathLike, base: str | None = None) -> Checkpoint:
    """Load what `folder` holds (see the module doc), in its saved dtype, with its tokenizer and its run's
    log history (for the model card). Errors are one-line ConfigErrors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"checkpoint {str(folder)!r} is not a folder")
    kind = layout(folder)
    if kind not in ("adapter", "full"):
        raise _refuse(folder, kind)
    info = _read_json(folder / RUN_INFO)
    state = _read_json(folder / "trainer_state.json")
    has_tokenizer = (folder / "tokenizer_config.json").exists()
    if kind == "full":
        model = _load(AutoModelForCausalLM, str(folder), "the model in", dtype="auto")
        source = str(folder) if has_tokenizer else info.get("base_model_path") or info.get("base_model") or str(folder)
    else:
        from peft import PeftModel

        from verifiers_rl.config.lora import quiet_peft_wrap

        source = _base_model(folder, base, info)
        model = _load(AutoModelForCausalLM, source, f"the base model of {folder},", dtype="auto")
        with quiet_peft_wrap():
            model = PeftModel.from_pretrained(model, str(folder))
        source = str(folder) if has_tokenizer else source
    tokenizer = _load(AutoTokenizer, source, "the tokenizer of")
    step = int(state.get("global_step") or info.get("step") or 0)
    return Checkpoint(model, tokenizer, step, state.get("log_history", []), info)
