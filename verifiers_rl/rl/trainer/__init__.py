"""The trainer package (public path used by verifiers 0.1.14's `verifiers.rl` shim)."""

from verifiers_rl.rl.trainer.utils import get_model, get_model_and_tokenizer

__all__ = ["get_model", "get_model_and_tokenizer"]
