"""Names that older verifiers code imports (`vf.GRPOTrainer`, `vf.grpo_defaults`, ...): thin, documented
aliases of the RL trainer, each with a DeprecationWarning that says what to use instead."""

from __future__ import annotations

import warnings

from verifiers_rl.config.lora import LORA_ALPHA, LORA_DROPOUT, LORA_RANK, lora_config
from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.trainer.trainer import RLTrainer


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)


class GRPOConfig(RLConfig):
    """Alias of RLConfig (the GRPO-family losses are selected with `loss_type`)."""

    def __post_init__(self):
        _deprecated("GRPOConfig", "RLConfig (loss_type='grpo' for the PPO-clip objective)")
        super().__post_init__()


class GRPOTrainer(RLTrainer):
    """Alias of RLTrainer: `GRPOTrainer(model, env, args)` with the same arguments in the same order."""

    def __init__(self, model, env, args=None, processing_class=None, **kwargs):
        _deprecated("GRPOTrainer", "RLTrainer")
        super().__init__(model, env, args=args, processing_class=processing_class, **kwargs)


def grpo_defaults(run_name: str | None = None, **overrides) -> RLConfig:
    """RLConfig with the defaults, named `run_name` (outputs go to outputs/<run_name>)."""
    _deprecated("grpo_defaults(run_name)", "RLConfig(run_name=...)")
    return RLConfig(run_name=run_name, **overrides)


def lora_defaults(r: int = LORA_RANK, alpha: int = LORA_ALPHA, dropout: float = LORA_DROPOUT, target_modules=None):
    """A peft LoraConfig on all attention and MLP projections (RLConfig's LoRA defaults)."""
    _deprecated("lora_defaults(r, alpha)", "RLConfig(lora_rank=..., lora_alpha=...)")
    return lora_config(r, alpha, dropout, target_modules)
