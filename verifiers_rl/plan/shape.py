"""A model's shape for planning, read from its config before anything loads: the sizes the memory planner counts
(`memory.py`), and whether vLLM's loader post-processes its weights after loading (`post_processed`), which a sync
of changes only cannot follow (plan/serving.py `check_changed_only`).
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

# Config keys of a mixture of experts, as vLLM's model classes read them (counted in vllm/model_executor/models of
# vLLM 0.32: num_experts, n_routed_experts, moe_num_experts, num_local_experts). vLLM's fused-MoE layers may reorder
# or repack the experts' weights for their kernel once loaded (FlashInfer's CUTLASS path, its default off Hopper);
# a quantized checkpoint's linear layers are repacked the same way (Marlin and others).
POST_PROCESSED_KEYS = ("num_experts", "n_routed_experts", "moe_num_experts", "num_local_experts")
QUANTIZED_KEY = "quantization_config"


def post_processed(get) -> str | None:
    """`key=value` of the first config entry that makes vLLM post-process the weights it loads, or None. `get(key)`
    reads the config (a dict's get); a multimodal model's language model is looked up in its `text_config` too."""
    for key in POST_PROCESSED_KEYS:
        value = get(key)
        if isinstance(value, list | tuple) and any(value) or isinstance(value, int | float) and value > 0:
            return f"{key}={value}"
    if get(QUANTIZED_KEY):
        return QUANTIZED_KEY
    text = get("text_config")
    if text:
        inner = post_processed(text.get if isinstance(text, dict) else lambda k: getattr(text, k, None))
        return f"text_config.{inner}" if inner else None
    return None


@dataclass(frozen=True)
class ModelShape:
    params: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    post_processed: str | None = None  # the config entry for which vLLM post-processes loaded weights (MoE)

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a model's config: a transformers config object or its config.json as a dict."""
        get = config.get if isinstance(config, dict) else functools.partial(getattr, config)
        hidden, layers = int(get("hidden_size")), int(get("num_hidden_layers"))
        heads = int(get("num_attention_heads"))
        kv = int(get("num_key_value_heads") or heads)
        head_dim = int(get("head_dim") or hidden // heads)
        inter, vocab = int(get("intermediate_size")), int(get("vocab_size"))
        per_layer = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2 + 3 * hidden * inter + 2 * hidden
        if str(get("model_type", "")).startswith("qwen3"):
            per_layer += 2 * head_dim  # q_norm and k_norm
        params = layers * per_layer + vocab * hidden * (1 if get("tie_word_embeddings", False) else 2) + hidden
        # a config object's own keys, as its config.json spells them (transformers maps Mixtral's num_experts to
        # num_local_experts)
        saved = config.to_dict() if hasattr(config, "to_dict") else config
        return cls(params, hidden, inter, layers, heads, kv, head_dim, vocab, post_processed(saved.get))


# Shapes of common checkpoints, for planning without their config at hand (a dry run on another machine).
KNOWN = {
    # name: (model_type, hidden, intermediate, layers, heads, kv heads, head_dim, vocab, tied embeddings)
    "qwen3-0.6b": ("qwen3", 1024, 3072, 28, 16, 8, 128, 151936, True),
    "qwen3-1.7b": ("qwen3", 2048, 6144, 28, 16, 8, 128, 151936, True),
    "qwen3-4b": ("qwen3", 2560, 9728, 36, 32, 8, 128, 151936, True),
    "qwen3-8b": ("qwen3", 4096, 12288, 36, 32, 8, 128, 151936, False),
    "qwen2.5-0.5b": ("qwen2", 896, 4864, 24, 14, 2, 64, 151936, True),
    "qwen2.5-1.5b": ("qwen2", 1536, 8960, 28, 12, 2, 128, 151936, True),
    "qwen2.5-7b": ("qwen2", 3584, 18944, 28, 28, 4, 128, 152064, False),
}
_KNOWN_KEYS = tuple(
    "model_type hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim "
    "vocab_size tie_word_embeddings".split()
)


def shape_of(model: str) -> ModelShape | None:
    """From a local folder's config.json, the Hugging Face cache, or the table of known shapes; None if unknown."""
    candidates = [Path(model) / "config.json"]
    cache = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
    candidates += sorted(cache.glob(f"models--{model.replace('/', '--')}/snapshots/*/config.json"))
    for path in candidates:
        if path.is_file():
            try:
                return ModelShape.from_config(json.loads(path.read_text()))
            except (ValueError, KeyError, TypeError):
                continue
    name = model.rstrip("/").split("/")[-1].lower()
    for known, values in KNOWN.items():
        if re.fullmatch(rf"{re.escape(known)}(-[\w.-]*)?", name):
            return ModelShape.from_config(dict(zip(_KNOWN_KEYS, values)))
    return None
