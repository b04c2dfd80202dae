"""The trainer's processes: how they hold the model (an accelerate config's layout).

`training_layout` reads an accelerate config the way `accelerate launch --config_file` does: DeepSpeed ZeRO-3,
FSDP version 2, or replicated (DDP, ZeRO-1/2). What one rank needs in that layout is `memory.rank_parts`, and
`memory.fit_training` plans it (and what to change when it does not fit).
"""

from __future__ import annotations

from pathlib import Path

from verifiers_rl.errors import ConfigError

LAYOUTS = ("ddp", "zero3", "fsdp2")


def training_layout(config: dict | None) -> str:
    """'zero3', 'fsdp2' or 'ddp' for an accelerate config (None: plain multi-process data parallel)."""
    if not config:
        return "ddp"
    kind = str(config.get("distributed_type", "")).upper()
    if kind == "DEEPSPEED":
        stage = int((config.get("deepspeed_config") or {}).get("zero_stage", 0))
        return "zero3" if stage == 3 else "ddp"  # ZeRO-1/2 shard optimizer state only: every rank holds the model
    if kind == "FSDP":
        version = int((config.get("fsdp_config") or {}).get("fsdp_version", 1))
        if version != 2:
            raise ConfigError(
                "trainer.accelerate_config: FSDP version 1 is not supported; set fsdp_config.fsdp_version: 2 (FSDP2, "
                "what TRL's async trainer and prime-rl use) or use DeepSpeed ZeRO-3"
            )
        return "fsdp2"
    return "ddp"


def read_accelerate_config(path: str | Path) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"trainer.accelerate_config={str(path)!r} does not exist")
    try:
        config = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"trainer.accelerate_config={str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"trainer.accelerate_config={str(path)!r} is not an accelerate config (a YAML mapping)")
    return config
