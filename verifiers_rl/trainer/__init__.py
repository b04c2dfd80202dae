"""Stage 9, the trainer: `RLTrainer`, a `transformers.Trainer` whose step is rollouts -> batch -> loss -> sync. Its
lifecycle hooks, callbacks and reward curve, checkpoints (sharded too), recovery from a lost server or a preempted
job, and the final model.

Names are resolved on first use (PEP 562), so that command-line tools can import light modules without importing
torch and transformers first.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "RLTrainer": "verifiers_rl.trainer.trainer",
    "RLConfig": "verifiers_rl.config.rl_config",
    "GRPOTrainer": "verifiers_rl.trainer.compat",
    "GRPOConfig": "verifiers_rl.trainer.compat",
    "grpo_defaults": "verifiers_rl.trainer.compat",
    "lora_defaults": "verifiers_rl.trainer.compat",
    "get_model": "verifiers_rl.models",
    "get_model_and_tokenizer": "verifiers_rl.models",
    "LiveRewardCurve": "verifiers_rl.export.reward_curve",
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
