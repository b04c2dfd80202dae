"""One GPU for both: how much of it the trainer needs, and what vLLM may take (`--gpu-memory-utilization`).

Pure functions of the model's shape and the run's settings, so `vf-rl --dry-run --gpus 1` can print the split
and the reasons before anything loads. The trainer's side is an estimate (weights, trainable state, activations
per micro-batch token, logprob chunks, CUDA context); its constants were checked against measured peaks on an
H100 (benchmarks/shared_gpu_memory.py, results in benchmarks/results/shared_gpu_memory.json). vLLM's side is
what vLLM itself accounts within its utilization fraction: weights, a warm-up/activation reserve and the KV
cache, of which at least one full sequence must fit.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
CUDA_CONTEXT = int(0.6 * GIB)  # per process: CUDA context + allocator slack
VLLM_RESERVE = int(1.5 * GIB)  # vLLM's activations at warm-up, sampler and graph buffers (enforce-eager: less)
LOGPROB_CHUNKS = 2 * (64 << 20)  # chunked_logprobs' logits budget, forward and backward
LORA_TARGETS = 7  # q, k, v, o, gate, up, down
# Activation bytes per token and layer, in units of (bytes per element x hidden) and (x intermediate), fitted to
# full fine-tuning peaks on an H100 (Qwen3-0.6B shape, bf16, SDPA); peft's LoRA layers keep ~1.55x that (their
# float32 adapter path), measured the same way.
ACT_HIDDEN, ACT_INTERMEDIATE, LORA_ACTIVATIONS = 12.0, 6.0, 1.55


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

    @classmethod
    def from_config(cls, cfg) -> ModelShape:
        get = (lambda k, d=None: cfg.get(k, d)) if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        hidden, layers = int(get("hidden_size")), int(get("num_hidden_layers"))
        heads = int(get("num_attention_heads"))
        kv = int(get("num_key_value_heads") or heads)
        head_dim = int(get("head_dim") or hidden // heads)
        inter, vocab = int(get("intermediate_size")), int(get("vocab_size"))
        per_layer = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2 + 3 * hidden * inter + 2 * hidden
        if str(get("model_type", "")).startswith("qwen3"):
            per_layer += 2 * head_dim  # q_norm and k_norm
        params = layers * per_layer + vocab * hidden * (1 if get("tie_word_embeddings", False) else 2) + hidden
        return cls(params, hidden, inter, layers, heads, kv, head_dim, vocab)


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
_KNOWN_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")  # fmt: skip


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


def lora_params(shape: ModelShape, rank: int) -> int:
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = (
        (shape.hidden + q) + 2 * (shape.hidden + kv) + (q + shape.hidden) + 3 * (shape.hidden + shape.intermediate)
    )
    return shape.layers * rank * per_layer


def trainer_bytes(shape: ModelShape, *, use_lora: bool, lora_rank: int, micro_batch_tokens: int,
                  gradient_checkpointing: bool, param_bytes: int = 2) -> dict[str, int]:  # fmt: skip
    """The trainer's peak, by part: weights, trainable state, activations of one micro-batch, logprob chunks,
    CUDA context."""
    weights = shape.params * param_bytes
    if use_lora:
        # peft keeps adapter weights in float32: weight + gradient + two AdamW moments
        state = lora_params(shape, lora_rank) * 16
    else:
        state = shape.params * (param_bytes + 2 * param_bytes)  # gradient + AdamW moments in the weights' dtype
    per_layer = param_bytes * (ACT_HIDDEN * shape.hidden + ACT_INTERMEDIATE * shape.intermediate)
    if use_lora:
        per_layer *= LORA_ACTIVATIONS
    if gradient_checkpointing:  # each layer's input is kept; one layer is recomputed at a time
        acts = micro_batch_tokens * (shape.layers * param_bytes * shape.hidden + per_layer)
    else:
        acts = micro_batch_tokens * shape.layers * per_layer
    parts = {"weights": weights, "trainable_state": state, "activations": int(acts), "logprobs": LOGPROB_CHUNKS,
             "cuda_context": CUDA_CONTEXT}  # fmt: skip
    parts["total"] = sum(parts.values())
    return parts


def kv_bytes_per_token(shape: ModelShape, param_bytes: int = 2) -> int:
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * param_bytes


@dataclass
class SharedGpuPlan:
    gpu_bytes: int
    trainer: dict[str, int]
    vllm_weights: int
    kv_cache: int
    kv_tokens: int
    gpu_memory_utilization: float

    def describe(self) -> list[str]:
        t = self.trainer
        return [
            f"one GPU of {self.gpu_bytes / GIB:.1f} GiB shared by the trainer and vLLM:",
            f"  trainer ~{t['total'] / GIB:.1f} GiB = weights {t['weights'] / GIB:.1f} + trainable state "
            f"{t['trainable_state'] / GIB:.1f} + activations {t['activations'] / GIB:.1f} + logprob chunks "
            f"{t['logprobs'] / GIB:.2f} + CUDA context {t['cuda_context'] / GIB:.1f}",
            f"  vLLM --gpu-memory-utilization {self.gpu_memory_utilization:.2f} = weights "
            f"{self.vllm_weights / GIB:.1f} "
            f"+ reserve {VLLM_RESERVE / GIB:.1f} + KV cache {self.kv_cache / GIB:.1f} GiB "
            f"(~{self.kv_tokens:,} tokens in flight)",
        ]


def plan_shared_gpu(shape: ModelShape, gpu_bytes: int, *, use_lora: bool, lora_rank: int, micro_batch_tokens: int,
                    max_seq_len: int, gradient_checkpointing: bool, param_bytes: int = 2,
                    headroom: float = 0.1) -> SharedGpuPlan:  # fmt: skip
    """Give the trainer its estimate plus `headroom`, and vLLM the rest (rounded down to 0.01 of the GPU).
    A ValueError says what does not fit and what to change."""
    trainer = trainer_bytes(
        shape, use_lora=use_lora, lora_rank=lora_rank, micro_batch_tokens=micro_batch_tokens,
        gradient_checkpointing=gradient_checkpointing, param_bytes=param_bytes,
    )  # fmt: skip
    vllm_weights = shape.params * param_bytes
    vllm_budget = gpu_bytes - int(trainer["total"] * (1 + headroom)) - CUDA_CONTEXT
    kv = vllm_budget - vllm_weights - VLLM_RESERVE
    per_token = kv_bytes_per_token(shape, param_bytes)
    if kv < per_token * max_seq_len:
        need = trainer["total"] * (1 + headroom) + CUDA_CONTEXT + vllm_weights + VLLM_RESERVE + per_token * max_seq_len
        raise ValueError(
            f"the trainer (~{trainer['total'] / GIB:.1f} GiB) and vLLM (~{(vllm_weights + VLLM_RESERVE) / GIB:.1f} GiB "
            f"+ KV cache for one {max_seq_len}-token sequence) need ~{need / GIB:.1f} GiB, the GPU has "
            f"{gpu_bytes / GIB:.1f}: use LoRA, activation_checkpointing, a smaller micro_batch_tokens, or a second GPU"
        )
    utilization = int(100 * vllm_budget / gpu_bytes) / 100
    return SharedGpuPlan(gpu_bytes, trainer, vllm_weights, kv, kv // per_token, utilization)
