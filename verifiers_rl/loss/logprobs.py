"""Per-token log-probabilities (and entropies) from final hidden states, without materialising [N, V] logits.

For row n with hidden state h_n, LM head (W, b) and temperature tau:

    z_n          = (h_n W^T + b).float() / tau                      (logits, float32)
    log p_n(y)   = z_n[y] - logsumexp(z_n)
    H_n          = -sum_v p_n(v) log p_n(v) = logsumexp(z_n) - sum_v p_n(v) z_n[v]

With a 150k vocabulary and a few thousand tokens, the float32 logits alone are several GiB, and autograd would
keep them (plus the softmax) alive until backward. `chunked_logprobs` instead processes `chunk_size` rows at a
time, saves only its inputs, and recomputes each chunk's logits in backward, where it writes the gradient with
respect to the LM head into one buffer: peak memory is O(chunk_size * V) + one [V, H] gradient instead of
O(N * V), for the price of one extra LM-head matmul per chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check_args(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N]={tuple(hidden.shape[:1])}, got {tuple(targets.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _scaled_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()
    # Skip the division at tau == 1 so that path saves nothing extra for backward.
    return logits if temperature == 1.0 else logits / temperature


def _in_head_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The hidden states in the head's dtype, as the model's own head would take them under autocast. Needed for a
    bf16-loaded model trained with bf16=True: accelerate's mixed precision turns the forward's outputs (these
    hidden states) into float32 while the head's weight stays bf16 (without the cast every shipped GPU config, bf16
    weights and bf16 = true, stops at step 1 on a GPU). The cast's backward returns the gradient in the hidden states'
    dtype."""
    return hidden if hidden.dtype == weight.dtype else hidden.to(weight.dtype)


def _entropy(logits: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """H = logsumexp(z) - sum softmax(z) * z, stable for very peaked distributions (`lse`: logsumexp(z) if known)."""
    lse = torch.logsumexp(logits, dim=-1) if lse is None else lse
    return lse - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


class _ChunkedLogprobs(torch.autograd.Function):
    """log p(targets) chunk by chunk, and a backward that recomputes each chunk's logits.

    Written as a Function rather than per-chunk activation checkpointing: under checkpointing autograd hands
    every chunk's [V, H] weight gradient to the engine separately and sums them in its own buffers, which costs
    several [V, H] copies at a 150k vocabulary. Here backward accumulates the weight gradient into one buffer
    in place (addmm_), so the extra memory is one [V, H] gradient plus one chunk of logits.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, with_entropy):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device) if with_entropy else None
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            z = _scaled_logits(hidden[start:stop], weight, bias, temperature)
            lse = torch.logsumexp(z, dim=-1)
            logp[start:stop] = z.gather(-1, targets[start:stop, None]).squeeze(-1) - lse
            if entropy is not None:
                entropy[start:stop] = _entropy(z, lse)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        if entropy is None:
            return logp, None
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, bias, targets = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if bias is not None and need_b else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            stop = min(start + ctx.chunk_size, hidden.shape[0])
            h, g_out = hidden[start:stop], grad_logp[start:stop, None].float()
            z = _scaled_logits(h, weight, bias, ctx.temperature)
            # d logp(y) / dz = onehot(y) - softmax(z), then through z = logits / T
            g = torch.softmax(z, dim=-1).mul_(-g_out)
            g.scatter_add_(1, targets[start:stop, None], g_out)
            if ctx.temperature != 1.0:
                g.div_(ctx.temperature)
            g = g.to(weight.dtype)
            if grad_h is not None:
                grad_h[start:stop] = g @ weight
            if grad_w is not None:
                grad_w.addmm_(g.t(), h)
            if grad_b is not None:
                grad_b += g.sum(dim=0)
        return grad_h, grad_w, grad_b, None, None, None, None


CHUNK_LOGITS_BYTES = 64 * 2**20  # float32 logits of one chunk: ~110 rows at Qwen's 152k vocabulary


def auto_chunk_size(vocab: int) -> int:
    """Rows per chunk so that one chunk's float32 logits take ~CHUNK_LOGITS_BYTES (between 32 and 4096 rows):
    memory then stays flat across vocabularies, and small vocabularies still get large, efficient matmuls."""
    return max(32, min(4096, CHUNK_LOGITS_BYTES // (4 * max(vocab, 1))))


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) [N] float32 (differentiable w.r.t. hidden, weight, bias) and entropy [N] (no grad) or None.

    Rows are processed `chunk_size` at a time (None: `auto_chunk_size(V)`); neither forward nor backward ever
    holds more than one chunk's [chunk_size, V] logits.
    """
    _check_args(hidden, weight, targets, temperature)
    if chunk_size is None:
        chunk_size = auto_chunk_size(weight.shape[0])
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    hidden = _in_head_dtype(hidden, weight)
    logp, entropy = _ChunkedLogprobs.apply(hidden, weight, bias, targets, temperature, chunk_size, with_entropy)
    return logp, entropy


def full_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The naive reference: full [N, V] float32 logits, log_softmax, gather. `chunk_size` is ignored."""
    del chunk_size
    _check_args(hidden, weight, targets, temperature)
    logits = _scaled_logits(_in_head_dtype(hidden, weight), weight, bias, temperature)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = _entropy(logits.detach())
    return logp, entropy


def logits_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, *, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) [N] float32 and entropy [N] (no grad) or None, from logits [N, V] a model already computed
    (a sharded output head is applied inside the model's forward)."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = _entropy(z.detach(), lse.detach())
    return logp, entropy


def output_head(model) -> torch.nn.Module:
    head = model.get_output_embeddings()
    # peft `modules_to_save` wraps the head; the trained copy is the active one
    if hasattr(head, "modules_to_save") and hasattr(head, "active_adapter"):
        active = head.active_adapter
        head = head.modules_to_save[active[0] if isinstance(active, (list, tuple)) else active]
    return head
