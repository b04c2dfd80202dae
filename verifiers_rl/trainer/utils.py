"""Public path of verifiers 0.1.14's shim (`vf.get_model`, `verifiers.rl.trainer.utils`).

Model loading lives in `verifiers_rl.models`, so that the inference server can load a model without importing
the trainer."""

from verifiers_rl.models import (
    default_attn_implementation,
    default_dtype,
    ensure_pad_token,
    get_model,
    get_model_and_tokenizer,
    get_tokenizer,
    resolve_model_path,
)

__all__ = [
    "default_attn_implementation",
    "default_dtype",
    "ensure_pad_token",
    "get_model",
    "get_model_and_tokenizer",
    "get_tokenizer",
    "resolve_model_path",
]
