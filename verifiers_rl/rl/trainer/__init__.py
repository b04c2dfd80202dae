"""The trainer package (public path used by verifiers 0.1.14's `verifiers.rl` shim)."""

from verifiers_rl.rl.trainer.compat import GRPOConfig, GRPOTrainer, grpo_defaults, lora_defaults
from verifiers_rl.rl.trainer.config import RLConfig
from verifiers_rl.rl.trainer.trainer import RLTrainer
from verifiers_rl.rl.trainer.utils import get_model, get_model_and_tokenizer

__all__ = [
    "RLTrainer",
    "RLConfig",
    "GRPOTrainer",
    "GRPOConfig",
    "grpo_defaults",
    "lora_defaults",
    "get_model",
    "get_model_and_tokenizer",
]
