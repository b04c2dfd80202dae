"""Per-request attention for the CPU engine's continuous batches.

transformers' continuous batching packs all requests of a step into one row. With SDPA (the only non-flash choice)
that row attends to the cached keys of *every* request under a dense block-diagonal mask, so a step costs
(sum of query tokens) x (sum of keys): prefilling 64 prompts of 60 tokens scores 3840 x 3840 pairs where
64 x 60 x 60 are needed (60x the work), and a decode step of 64 requests scores 64 x (64 x L) instead of 64 x L.
On GPU, flash-attention's varlen kernels (cu_seqlens) avoid this; on CPU there is no such kernel, so this module
regroups the packed row into a padded [requests, heads, length, dim] batch and runs one SDPA call with a
per-request causal mask: work proportional to max_q x max_k per request.

Registered under NAME with transformers' AttentionInterface (its public hook for custom attention) and selected by
the engine after continuous batching is initialised. Anything this function does not handle (no paged cache,
sliding windows, several cache layer types) goes to transformers' own SDPA path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "vf_cpu_varlen"


def varlen_layout(cu_q: list[int], cu_k: list[int]) -> dict:
    """Gather indices and mask that turn packed per-request spans into a padded batch.

    Request i owns queries cu_q[i]:cu_q[i+1] and keys cu_k[i]:cu_k[i+1] of the packed row; its queries are the
    last q_i positions of its k_i keys, so query j may see keys 0 .. k_i - q_i + j (bottom-right causal).
    Returns q_index [B, Qmax], k_index [B, Kmax] (padding points at index 0), mask [B, 1, Qmax, Kmax] (True =
    attend) and q_valid [B, Qmax].
    """
    q_start, k_start = torch.tensor(cu_q[:-1]), torch.tensor(cu_k[:-1])
    q_len = torch.tensor(cu_q[1:]) - q_start
    k_len = torch.tensor(cu_k[1:]) - k_start
    q_max, k_max = int(q_len.max()), int(k_len.max())
    qi, ki = torch.arange(q_max), torch.arange(k_max)
    q_valid = qi[None, :] < q_len[:, None]
    k_valid = ki[None, :] < k_len[:, None]
    # a query may see key t when t <= (k_len - q_len) + j
    horizon = (k_len - q_len)[:, None] + qi[None, :]  # [B, Qmax]
    mask = (ki[None, None, :] <= horizon[:, :, None]) & k_valid[:, None, :]
    # padded query rows see key 0 only, so softmax stays finite; their outputs are dropped
    mask[:, :, 0] |= ~q_valid
    return {
        "q_index": torch.where(q_valid, q_start[:, None] + qi[None, :], 0),
        "k_index": torch.where(k_valid, k_start[:, None] + ki[None, :], 0),
        "mask": mask[:, None],
        "q_valid": q_valid,
        "dense_cost": cu_q[-1] * cu_k[-1],
        "padded_cost": len(q_len) * q_max * k_max,
    }


def varlen_sdpa(
    query: torch.Tensor,  # [1, H, Tq, D] packed
    key: torch.Tensor,  # [1, KVH, Tk, D] packed, requests contiguous and in the same order as the queries
    value: torch.Tensor,
    layout: dict[str, torch.Tensor],
    scaling: float | None,
) -> torch.Tensor:
    """Attention of each request's queries to its own keys; returns [1, Tq, H, D] like transformers' SDPA path."""
    q = query[0][:, layout["q_index"]].transpose(0, 1)  # [B, H, Qmax, D]
    k = key[0][:, layout["k_index"]].transpose(0, 1)  # [B, KVH, Kmax, D]
    v = value[0][:, layout["k_index"]].transpose(0, 1)
    gqa = query.shape[1] != key.shape[1]  # SDPA shares each KV head across its query heads without copying
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=layout["mask"], scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2)[layout["q_valid"]].unsqueeze(0)  # [1, Tq, H, D]


class _LayoutCache:
    """One layout per step: every layer of a forward pass sees the same cu_seq_lens."""

    def __init__(self):
        self.key: tuple | None = None
        self.layout: dict | None = None

    def get(self, cu_q: torch.Tensor, cu_k: torch.Tensor) -> dict:
        key = (tuple(cu_q.tolist()), tuple(cu_k.tolist()))
        if key != self.key:
            self.key, self.layout = key, varlen_layout(list(key[0]), list(key[1]))
        return self.layout


_layouts = _LayoutCache()


def paged_varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, cache=None, **kwargs):
    """AttentionInterface function: transformers' SDPA path for what it does not handle, per-request SDPA otherwise."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (
        not isinstance(cache, PagedAttentionCache)
        or getattr(module, "sliding_window", None) is not None
        or not isinstance(kwargs.get("cu_seq_lens_k"), dict)
        or len(kwargs["cu_seq_lens_k"]) != 1
        or dropout
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, cache=cache, **kwargs
        )
    key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs)
    layout = _layouts.get(kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"])
    if layout["padded_cost"] > layout["dense_cost"]:  # very uneven requests: the dense mask is cheaper
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return varlen_sdpa(query, key, value, layout, scaling), None


# Kept by bench_cpu_tunings' row "engine loop: transformers CB with its SDPA vs our varlen attention" (>= 1.1x).
def install(model) -> None:
    """Register the function and switch `model` (already set up for continuous batching) to it."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, paged_varlen_attention)
    model.set_attn_implementation(NAME)
