"""Per-token log-probabilities (and entropies) from final hidden states, without materialising [N, V] logits.

For row n with hidden state h_n, LM head (W, b) and temperature tau:

    z_n          = (h_n W^T + b).float() / tau                      (logits, float32)
    log p_n(y)   = z_n[y] - logsumexp(z_n)
    H_n          = -sum_v p_n(v) log p_n(v) = logsumexp(z_n) - sum_v p_n(v) z_n[v]

With a 150k vocabulary and a few thousand tokens, the float32 logits alone are several GiB, and autograd would
keep them (plus the softmax) alive until backward. `chunked_logprobs` instead processes `chunk_size` rows at a
time under non-reentrant activation checkpointing, so only the chunk's *inputs* are saved and backward
recomputes that chunk's logits: peak memory is O(chunk_size * V) instead of O(N * V), for the price of one
extra LM-head matmul per chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


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


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum softmax(z) * z, stable for very peaked distributions."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def _chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = _scaled_logits(hidden, weight, bias, temperature)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    entropy = None
    if with_entropy:
        # Computed last and without grad: checkpoint's early stop then skips it when backward recomputes.
        with torch.no_grad():
            entropy = _entropy(logits.detach())
    return logp, entropy


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

    Rows are processed `chunk_size` at a time (None: `auto_chunk_size(V)`); each chunk runs under
    checkpoint(use_reentrant=False), so neither forward nor backward ever holds more than one chunk's
    [chunk_size, V] logits.
    """
    _check_args(hidden, weight, targets, temperature)
    if chunk_size is None:
        chunk_size = auto_chunk_size(weight.shape[0])
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    n = hidden.shape[0]
    logps, entropies = [], []
    # max(n, 1): an empty input still runs one (empty) chunk so the result stays attached to the graph.
    for start in range(0, max(n, 1), chunk_size):
        stop = min(start + chunk_size, n)
        logp, ent = checkpoint(
            _chunk,
            hidden[start:stop],
            weight,
            bias,
            targets[start:stop],
            temperature,
            with_entropy,
            use_reentrant=False,
        )
        logps.append(logp)
        entropies.append(ent)
    logp = logps[0] if len(logps) == 1 else torch.cat(logps)
    entropy = torch.cat(entropies) if with_entropy else None
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
    logits = _scaled_logits(hidden, weight, bias, temperature)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = _entropy(logits.detach())
    return logp, entropy
