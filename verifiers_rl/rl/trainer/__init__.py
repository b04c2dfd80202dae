"""verifiers 0.1.14 import path: `verifiers_rl.rl.trainer` (RLTrainer, RLConfig, GRPOTrainer, GRPOConfig,
grpo_defaults, lora_defaults, get_model, get_model_and_tokenizer), resolved lazily from `verifiers_rl.trainer`."""

from __future__ import annotations

import verifiers_rl.trainer as _trainer

__all__ = list(_trainer.__all__)


def __getattr__(name: str):
    return getattr(_trainer, name)


def __dir__():
    return sorted(set(globals()) | set(__all__))
