"""The trainer package (public path used by verifiers 0.1.14's `verifiers.rl` shim).

Names are resolved on first use (PEP 562), so that light modules of this package (config checks, LoRA defaults)
can be imported by the command-line tools without importing torch and transformers first.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "RLTrainer": "verifiers_rl.rl.trainer.trainer",
    "RLConfig": "verifiers_rl.rl.trainer.config",
    "GRPOTrainer": "verifiers_rl.rl.trainer.compat",
    "GRPOConfig": "verifiers_rl.rl.trainer.compat",
    "grpo_defaults": "verifiers_rl.rl.trainer.compat",
    "lora_defaults": "verifiers_rl.rl.trainer.compat",
    "get_model": "verifiers_rl.models",
    "get_model_and_tokenizer": "verifiers_rl.models",
    "LiveRewardCurve": "verifiers_rl.rl.trainer.reward_curve",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
