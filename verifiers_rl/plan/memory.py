"""The memory planner: what one trainer rank needs, and what vLLM may take of a GPU it shares with the trainer.

Pure functions of the model's shape and the run's settings, so `vf-rl --dry-run` can print the plan and its
reasons before anything loads. `fit_training` plans one trainer rank (any layout, a GPU of its own or shared with
vLLM) and, when the run as configured does not fit, chooses activation checkpointing and then a token budget per
micro-batch. The trainer's side counts what a step holds (weights, trainable state, the tensors each layer saves
for backward, chunked logprobs, CUDA context), checked against peaks measured on CPU
(tests/unit/test_memory_measured.py) and on an H100 (benchmarks/shared_gpu_memory.py). vLLM's side is what vLLM
itself accounts within its utilization fraction: weights, a warm-up/activation reserve and the KV cache, of which
at least one full sequence must fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from verifiers_rl.errors import ConfigError
from verifiers_rl.plan.shape import _KNOWN_KEYS, KNOWN, ModelShape, shape_of  # noqa: F401  (their old home)

GIB = 1 << 30
CUDA_CONTEXT = int(0.6 * GIB)  # per process: CUDA context + allocator slack
VLLM_RESERVE = int(1.5 * GIB)  # vLLM's activations at warm-up, sampler and graph buffers (enforce-eager: less)
CHUNK_LOGITS_BYTES = 64 << 20  # logprobs.CHUNK_LOGITS_BYTES (that module imports torch; this one must not)
LORA_TARGETS = 7  # q, k, v, o, gate, up, down
FLOAT32 = 4
# Bytes per token outside the decoder layers, in units of (bytes per element x hidden): the embedding output, the
# final norm, the trained positions' hidden states handed to the head, and the backward's transient gradients of
# one layer. Checked with the per-layer counts against peaks measured on CPU (Qwen3-0.6B's layer shape, bf16
# autocast and SDPA as the trainer runs them; tests/unit/test_memory_measured.py): within 8 %.
ACT_FIXED = 10.0
Layout = Literal["ddp", "zero3", "fsdp2"]


def lora_params(shape: ModelShape, rank: int) -> int:
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = (
        (shape.hidden + q) + 2 * (shape.hidden + kv) + (q + shape.hidden) + 3 * (shape.hidden + shape.intermediate)
    )
    return shape.layers * rank * per_layer


def layer_activation_bytes(shape: ModelShape, *, use_lora: bool, lora_rank: int, param_bytes: int = 2) -> int:
    """Bytes one decoder layer keeps for backward, per token: the tensors autograd saves in a Llama/Qwen-style
    layer under SDPA, counted from what the layer computes (and checked against measured peaks on CPU):

    - each RMSNorm keeps its float32 input, and, when its weight trains, its cast back and the scaled output;
    - attention keeps q and k after their norms (float32 input, and the cast when the norm weight trains), after
      RoPE, v, k and v repeated to all heads (packed rows carry a mask, and with a mask transformers repeats them
      instead of using SDPA's GQA), and the attention output;
    - the MLP keeps gate, up, silu(gate) and, when down_proj trains, its input;
    - peft's LoRA layers keep each adapted projection's input and the rank-r output of A in the compute dtype:
      peft casts the input to the adapter's float32, and autocast (bf16 = true) casts that copy back for the
      adapter's matmul, which keeps the cast; the frozen base projections keep nothing.
    """
    b, h, i = param_bytes, shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    attention = FLOAT32 * (q + kv) + b * (4 * q + 2 * kv)
    if use_lora:
        norms = 2 * FLOAT32 * h
        adapters = b * ((3 * h) + q + (2 * h) + i + LORA_TARGETS * lora_rank)  # q/k/v, o, gate/up, down
        return norms + attention + adapters + 3 * b * i
    return 2 * (FLOAT32 * h + 2 * b * h) + attention + b * (q + kv) + 4 * b * i


def activation_bytes(
    shape: ModelShape,
    *,
    use_lora: bool,
    lora_rank: int,
    micro_batch_tokens: int,
    max_seq_len: int | None,
    activation_checkpointing: bool,
    param_bytes: int = 2,
) -> int:
    """One micro-batch's activations at their peak (the start of backward). Packing bounds a micro-batch by its
    token budget, so this is linear in `micro_batch_tokens`; SDPA's mask over packed rows as wide as the longest
    sample (`max_seq_len` at worst) adds rows x width^2 = tokens x width per layer, in the weights' dtype as torch
    converts a boolean mask. With checkpointing each layer keeps only its input, and one layer is recomputed at a
    time."""
    per_layer = layer_activation_bytes(shape, use_lora=use_lora, lora_rank=lora_rank, param_bytes=param_bytes)
    width = min(max_seq_len or micro_batch_tokens, micro_batch_tokens)
    per_layer += width * param_bytes
    fixed = ACT_FIXED * param_bytes * shape.hidden
    if activation_checkpointing:
        per_token = shape.layers * param_bytes * shape.hidden + per_layer + fixed
    else:
        per_token = shape.layers * per_layer + fixed
    return int(micro_batch_tokens * per_token)


def chunk_rows(vocab: int) -> int:
    """logprobs.auto_chunk_size: rows whose float32 logits take ~CHUNK_LOGITS_BYTES."""
    return max(32, min(4096, CHUNK_LOGITS_BYTES // (FLOAT32 * max(vocab, 1))))


def logprob_bytes(
    shape: ModelShape,
    *,
    trains_head: bool,
    param_bytes: int = 2,
    tokens: int | None = None,
    grad_bytes: int | None = None,
) -> int:
    """chunked_logprobs never holds the micro-batch's logits: one chunk's float32 logits in forward, their
    softmax (float32) and its cast in backward (a chunk has at most `tokens` rows); when the head trains, backward
    accumulates its [V, H] gradient in a buffer of its own before autograd adds it to the weight's gradient."""
    rows = min(chunk_rows(shape.vocab), tokens or chunk_rows(shape.vocab))
    chunk = rows * shape.vocab * (2 * FLOAT32 + param_bytes)
    return chunk + (shape.vocab * shape.hidden * (grad_bytes or param_bytes) if trains_head else 0)


def rank_parts(
    shape: ModelShape,
    *,
    layout: Layout,
    ranks: int,
    use_lora: bool,
    lora_rank: int,
    micro_batch_tokens: int,
    max_seq_len: int | None,
    activation_checkpointing: bool,
    param_bytes: int = 2,
    master_bytes: int = FLOAT32,
    sync_snapshot: bool = False,
) -> dict[str, int]:
    """One trainer rank's peak by part. ZeRO-3 and FSDP2 divide parameters, gradients and optimizer state by the
    number of ranks; DDP keeps them whole on every rank; activations are per rank either way. A LoRA adapter
    trains in float32 (peft's default): weight 4 bytes, gradient 4, two AdamW moments 8. Full fine-tuning keeps
    float32 master weights (`master_bytes`; models.training_kwargs), so gradient 4 and moments 8 too; the
    `param_bytes` copies autocast casts for compute are tensors backward keeps, counted with the activations.
    `sync_snapshot`: sync_changed_only's last-sent weights, whole, on the sending rank (sync/delta.py)."""
    shard = ranks if layout in ("zero3", "fsdp2") else 1
    casts = 0
    if use_lora:
        trainable, grad_bytes, optim_bytes = lora_params(shape, lora_rank), FLOAT32, 2 * FLOAT32
        weights = shape.params * param_bytes // shard + trainable * FLOAT32
    else:
        trainable, grad_bytes, optim_bytes = shape.params, master_bytes, 2 * master_bytes
        weights = shape.params * master_bytes // shard
        if master_bytes > param_bytes:
            casts = _compute_copies(shape, param_bytes, activation_checkpointing, shard)
    parts = {
        "parameters": weights,
        "gradients": trainable * grad_bytes // shard,
        "optimizer": trainable * optim_bytes // shard,
        "activations": activation_bytes(
            shape,
            use_lora=use_lora,
            lora_rank=lora_rank,
            micro_batch_tokens=micro_batch_tokens,
            max_seq_len=max_seq_len,
            activation_checkpointing=activation_checkpointing,
            param_bytes=param_bytes,
        )
        + casts,
        "logprobs": logprob_bytes(
            shape, trains_head=not use_lora, param_bytes=param_bytes, tokens=micro_batch_tokens, grad_bytes=grad_bytes
        ),
        "cuda_context": CUDA_CONTEXT,
    }
    if sync_snapshot:
        parts["sync_snapshot"] = shape.params * param_bytes
    parts["total"] = sum(parts.values())
    return parts


def _compute_copies(shape: ModelShape, param_bytes: int, activation_checkpointing: bool, shard: int) -> int:
    """The `param_bytes` copies autocast makes of float32 weights, which backward keeps until it has used them:
    every layer's without activation checkpointing; with it, the output head's and one recomputed layer's (the
    other layers cast again when recomputed). Sharded layouts cast gathered layers one at a time."""
    head = shape.vocab * shape.hidden
    layer = (shape.params - head) // max(shape.layers, 1)
    if activation_checkpointing or shard > 1:
        return (head + layer) * param_bytes
    return shape.params * param_bytes


def kv_bytes_per_token(shape: ModelShape, param_bytes: int = 2) -> int:
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * param_bytes


PART_NAMES = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer": "optimizer",
    "activations": "activations",
    "logprobs": "logprob chunks",
    "cuda_context": "CUDA context",
    "sync_snapshot": "sync snapshot",  # only with sync_changed_only
}
_HOW = {"ddp": "whole on every rank", "zero3": "ZeRO-3 shards", "fsdp2": "FSDP2 shards"}
TOKEN_STEP = 256  # a chosen micro_batch_tokens is a multiple of this (and at least max_seq_len)


@dataclass(frozen=True)
class MemoryFit:
    """The memory plan of a run: one trainer rank's peak by part, what the planner changed to make it fit (RLConfig
    fields and values, to apply before launch) and why, and vLLM's share of a GPU it shares with the trainer."""

    layout: Layout
    ranks: int
    gpu_bytes: int
    parts: dict[str, int]  # one trainer rank's peak by part (rank_parts), plus "total"
    measures: dict[str, object] = field(default_factory=dict)  # {} when the run fits as configured
    reasons: list[str] = field(default_factory=list)  # one line per measure: what and why
    gpu_memory_utilization: float | None = None  # vLLM's fraction of a GPU shared with the trainer, else None
    vllm: dict[str, int] | None = None  # shared GPU: vLLM's weights, reserve, kv_cache and kv_tokens

    def describe(self) -> list[str]:
        p = self.parts
        terms = " + ".join(f"{name} {p[key] / GIB:.2f}" for key, name in PART_NAMES.items() if key in p)
        lines = [
            f"each of {self.ranks} trainer rank(s) ({_HOW[self.layout]}): {terms} = ~{p['total'] / GIB:.1f} GiB "
            f"of {self.gpu_bytes / GIB:.1f} GiB"
        ]
        lines += [f"  chose {reason}" for reason in self.reasons]
        if self.vllm is not None and self.gpu_memory_utilization is not None:
            v = self.vllm
            lines.append(
                f"  vLLM --gpu-memory-utilization {self.gpu_memory_utilization:.2f} on the same GPU = weights "
                f"{v['weights'] / GIB:.1f} + reserve {v['reserve'] / GIB:.1f} + KV cache {v['kv_cache'] / GIB:.1f} "
                f"GiB (~{v['kv_tokens']:,} tokens in flight)"
            )
        return lines


def fit_training(
    shape: ModelShape,
    gpu_bytes: int,
    *,
    layout: Layout,
    ranks: int,
    use_lora: bool,
    lora_rank: int,
    micro_batch_size: int,
    max_seq_len: int,
    micro_batch_tokens: int | None,
    activation_checkpointing: bool | None,
    shared_with_server: bool,
    gpu_memory_utilization: float | None = None,
    param_bytes: int = 2,
    headroom: float = 0.1,
    sync_snapshot: bool = False,
) -> MemoryFit:
    """Plan one trainer rank's memory, and vLLM's share when it shares the GPU.

    `micro_batch_tokens` and `activation_checkpointing` are None when the user did not set them: the planner may
    then choose them. The run as configured is tried first; if it does not fit, the cheapest measure that does:
    activation checkpointing (costs one extra forward per layer), then the largest token budget per micro-batch
    that fits (>= max_seq_len, so one full sample always fits). A GPU shared with the server must also hold vLLM's
    weights, a reserve and the KV cache of one full sequence, plus `headroom` on the trainer's estimate; a
    `gpu_memory_utilization` the user wrote is kept and the trainer must fit beside it. A ConfigError (one line)
    names what to change when nothing fits, never a setting that is already so.
    """
    vllm_need = shape.params * param_bytes + VLLM_RESERVE + kv_bytes_per_token(shape, param_bytes) * max_seq_len
    if not shared_with_server:
        budget = gpu_bytes
    elif gpu_memory_utilization is not None:
        budget = int((gpu_bytes - gpu_memory_utilization * gpu_bytes) / (1 + headroom))
    else:
        budget = int((gpu_bytes - CUDA_CONTEXT - vllm_need) / (1 + headroom))

    def parts(tokens: int, checkpointing: bool) -> dict[str, int]:
        return rank_parts(
            shape,
            layout=layout,
            ranks=ranks,
            use_lora=use_lora,
            lora_rank=lora_rank,
            micro_batch_tokens=tokens,
            max_seq_len=max_seq_len,
            activation_checkpointing=checkpointing,
            param_bytes=param_bytes,
            sync_snapshot=sync_snapshot,
        )

    tokens = micro_batch_tokens or micro_batch_size * max_seq_len
    configured = parts(tokens, bool(activation_checkpointing))
    chosen, checkpointing, measures, reasons = _choose_measures(
        parts, configured, tokens, budget, activation_checkpointing, micro_batch_tokens, max_seq_len
    )
    if chosen["total"] > budget:
        why = _refusal(
            configured,
            chosen,
            budget,
            gpu_bytes,
            layout,
            use_lora,
            checkpointing,
            micro_batch_tokens,
            max_seq_len,
            shared_with_server,
            gpu_memory_utilization,
        )
        raise ConfigError(why)
    fit = MemoryFit(layout, ranks, gpu_bytes, chosen, measures, reasons)
    if not shared_with_server:
        return fit
    return _share_with_vllm(fit, shape, max_seq_len, gpu_memory_utilization, param_bytes, headroom)


def _choose_measures(
    parts,
    configured: dict[str, int],
    tokens: int,
    budget: int,
    activation_checkpointing: bool | None,
    micro_batch_tokens: int | None,
    max_seq_len: int,
) -> tuple[dict[str, int], bool, dict[str, object], list[str]]:
    """The cheapest measures that bring one rank within `budget`, among the settings the user left unset (None):
    activation checkpointing first, then the largest token budget per micro-batch. Returns the rank's parts
    (what one full sample alone needs when nothing fits, for the refusal), whether it checkpoints, the measures
    and one reason per measure. `parts(tokens, checkpointing)` is one rank's peak by part."""
    chosen, checkpointing = configured, bool(activation_checkpointing)
    measures: dict[str, object] = {}
    reasons: list[str] = []
    if chosen["total"] > budget and activation_checkpointing is None:
        checkpointing, before = True, chosen
        chosen = parts(tokens, checkpointing)
        measures["activation_checkpointing"] = True
        reasons.append(
            f"activation_checkpointing = true: activations {before['activations'] / GIB:.1f} -> "
            f"{chosen['activations'] / GIB:.1f} GiB for {tokens:,} tokens a micro-batch "
            f"(one rank ~{before['total'] / GIB:.1f} GiB, {budget / GIB:.1f} GiB available)"
        )
    if chosen["total"] > budget and micro_batch_tokens is None:
        fit = _largest_budget(lambda t: parts(t, checkpointing)["total"] <= budget, max_seq_len, tokens)
        if fit is None:  # what one full sample alone needs, for the refusal
            chosen = parts(max_seq_len, checkpointing)
        else:
            before, chosen = chosen, parts(fit, checkpointing)
            measures["micro_batch_tokens"] = fit
            reasons.append(
                f"micro_batch_tokens = {fit}: the worst case micro_batch_size x max_seq_len = {tokens:,} tokens "
                f"needs ~{before['total'] / GIB:.1f} GiB a rank, {budget / GIB:.1f} GiB available; packing "
                f"bounds a micro-batch by this budget (activations {chosen['activations'] / GIB:.1f} GiB)"
            )
    return chosen, checkpointing, measures, reasons


def _share_with_vllm(
    fit: MemoryFit,
    shape: ModelShape,
    max_seq_len: int,
    gpu_memory_utilization: float | None,
    param_bytes: int,
    headroom: float,
) -> MemoryFit:
    """`fit` with vLLM's share of the GPU it shares with the trainer: the utilization the user wrote, or what the
    trainer's estimate plus `headroom` leaves (rounded down to 0.01); a ConfigError when that share cannot hold
    vLLM's weights, reserve and the KV cache of one full sequence."""
    gpu_bytes, per_token = fit.gpu_bytes, kv_bytes_per_token(shape, param_bytes)
    vllm_fixed, one_sequence = shape.params * param_bytes + VLLM_RESERVE, per_token * max_seq_len
    if gpu_memory_utilization is None:
        vllm_budget = gpu_bytes - int(fit.parts["total"] * (1 + headroom)) - CUDA_CONTEXT
        gpu_memory_utilization = int(100 * vllm_budget / gpu_bytes) / 100
    kv = int(gpu_memory_utilization * gpu_bytes) - vllm_fixed
    if kv < one_sequence:
        raise ConfigError(
            f"[inference.args] gpu_memory_utilization = {gpu_memory_utilization} gives vLLM "
            f"{gpu_memory_utilization * gpu_bytes / GIB:.1f} GiB of {gpu_bytes / GIB:.1f}, less than its weights and "
            f"reserve ({vllm_fixed / GIB:.1f} GiB) plus the KV cache of one {max_seq_len}-token sequence "
            f"({one_sequence / GIB:.2f} GiB): raise it, or leave it unset and the planner splits the GPU"
        )
    vllm = {
        "weights": shape.params * param_bytes,
        "reserve": VLLM_RESERVE,
        "kv_cache": kv,
        "kv_tokens": kv // per_token,
    }
    return replace(fit, gpu_memory_utilization=gpu_memory_utilization, vllm=vllm)


def _largest_budget(fits, low: int, high: int) -> int | None:
    """The largest token budget in [low, high] (a multiple of TOKEN_STEP above `low`) for which `fits` holds;
    None when even `low` does not. Memory grows with the budget, so a bisection finds it."""
    if not fits(low):
        return None
    lo, hi = 0, (high - low) // TOKEN_STEP  # candidate k: low rounded up to the step, plus k steps
    base = -(-low // TOKEN_STEP) * TOKEN_STEP
    if base > high or not fits(base):
        return low
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if base + mid * TOKEN_STEP <= high and fits(base + mid * TOKEN_STEP):
            lo = mid
        else:
            hi = mid - 1
    return base + lo * TOKEN_STEP


def _refusal(
    configured: dict[str, int],
    best: dict[str, int],
    budget: int,
    gpu_bytes: int,
    layout: Layout,
    use_lora: bool,
    checkpointing: bool,
    micro_batch_tokens: int | None,
    max_seq_len: int,
    shared: bool,
    gpu_memory_utilization: float | None,
) -> str:
    """One line: what one rank needs at best, what it has, and only the settings whose change would help."""
    if layout == "ddp":  # every rank holds the whole model: more ranks do not help, sharding does
        fixes = ["shard the model over trainer GPUs ([trainer] gpus, accelerate_config: DeepSpeed ZeRO-3 or FSDP2)"]
    else:
        fixes = ["more trainer GPUs ([trainer] gpus, or more nodes)"]
    if not use_lora:
        fixes.append("LoRA (use_lora = true)")
    if not checkpointing:
        fixes.append("activation_checkpointing = true")
    if micro_batch_tokens is not None and micro_batch_tokens > max_seq_len:
        fixes.append(f"a smaller micro_batch_tokens (now {micro_batch_tokens})")
    fixes += [f"a shorter max_seq_len (now {max_seq_len})"] + ["sync_changed_only = false"] * ("sync_snapshot" in best)
    if shared and gpu_memory_utilization is None:
        fixes.append("a second GPU, so that the server has one of its own")
    terms = ", ".join(f"{name} {best[key] / GIB:.2f}" for key, name in PART_NAMES.items() if key in best)
    at_best = f"~{best['total'] / GIB:.1f} GiB ({terms})"
    if best is not configured:
        at_best += f" even at the planner's smallest setting (as configured ~{configured['total'] / GIB:.1f})"
    if shared and gpu_memory_utilization is not None:
        room = (
            f"the {gpu_bytes / GIB:.1f} GiB GPU less vLLM's gpu_memory_utilization = {gpu_memory_utilization} "
            f"({gpu_memory_utilization * gpu_bytes / GIB:.1f} GiB) leaves {budget / GIB:.1f} GiB"
        )
        fixes.insert(0, "a smaller [inference.args] gpu_memory_utilization (or unset, for the planner to split)")
    elif shared:
        room = f"the {gpu_bytes / GIB:.1f} GiB GPU it shares with vLLM leaves {budget / GIB:.1f} GiB"
    else:
        room = f"its GPU has {gpu_bytes / GIB:.1f} GiB"
    return f"one trainer rank needs {at_best}, {room}: change to fit: {', '.join(fixes)}"
