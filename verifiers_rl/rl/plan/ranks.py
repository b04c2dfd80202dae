"""The trainer's processes: how they hold the model (an accelerate config's layout) and what each one needs.

`training_layout` reads an accelerate config the way `accelerate launch --config_file` does: DeepSpeed ZeRO-3,
FSDP version 2, or replicated (DDP, ZeRO-1/2). `rank_memory` is one trainer rank's peak by part for that layout:
ZeRO-3 and FSDP2 divide parameters, gradients and optimizer state by the number of ranks, DDP keeps them whole
on every rank; activations are per rank either way. `vf-rl --dry-run` prints it and refuses a plan that cannot
fit the GPU, naming what to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from verifiers_rl.errors import ConfigError
from verifiers_rl.rl.plan.memory import GIB, ModelShape, rank_parts

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


@dataclass(frozen=True)
class RankMemory:
    layout: str
    ranks: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    other: int  # logprob chunks, CUDA context

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.other

    def describe(self) -> str:
        how = {"ddp": "whole on every rank", "zero3": "ZeRO-3 shards", "fsdp2": "FSDP2 shards"}[self.layout]
        parts = (self.parameters, self.gradients, self.optimizer, self.activations, self.other, self.total)
        p, g, o, a, x, t = (f"{v / GIB:.2f}" for v in parts)
        return (
            f"each of {self.ranks} trainer rank(s) ({how}): parameters {p} + gradients {g} + optimizer {o} + "
            f"activations {a} + logprobs/CUDA {x} = ~{t} GiB"
        )


def rank_memory(shape: ModelShape, *, layout: str, ranks: int, use_lora: bool, lora_rank: int,
                micro_batch_tokens: int, gradient_checkpointing: bool, param_bytes: int = 2) -> RankMemory:  # fmt: skip
    """One trainer rank's peak by part (memory.rank_parts, which fit_training plans with)."""
    p = rank_parts(
        shape, layout=layout, ranks=ranks, use_lora=use_lora, lora_rank=lora_rank,
        micro_batch_tokens=micro_batch_tokens, max_seq_len=None, activation_checkpointing=gradient_checkpointing,
        param_bytes=param_bytes,
    )  # fmt: skip
    return RankMemory(layout, ranks, p["parameters"], p["gradients"], p["optimizer"], p["activations"],
                      p["logprobs"] + p["cuda_context"])  # fmt: skip


def check_fits(memory: RankMemory, gpu_bytes: int) -> None:
    """A ConfigError naming what to change when one trainer rank needs more than its GPU has."""
    if memory.total <= gpu_bytes:
        return
    fixes = []
    if memory.layout == "ddp":
        fixes.append("shard the model (trainer.accelerate_config with DeepSpeed ZeRO-3 or FSDP2)")
    else:
        fixes.append("more trainer GPUs ([trainer] gpus, or more nodes)")
    fixes += ["LoRA (use_lora = true)", "activation_checkpointing = true", "a smaller micro_batch_tokens"]
    raise ConfigError(
        f"one trainer rank needs ~{memory.total / GIB:.1f} GiB, its GPU has {gpu_bytes / GIB:.1f} GiB "
        f"({memory.describe()}): use {', '.join(fixes)}"
    )
