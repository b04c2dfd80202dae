"""Shared-prompt attention by span: each segment of a shared-prompt row attends to its prefix and itself only.

prefix_sharing.py lays a group out as one row `[prefix | suffix_1 | ... | suffix_G]` with a dense [L, L] mask.
SDPA then scores every query against every key of the row and throws most of it away: at 8 rollouts of 128
tokens behind a 125-token prompt, a row is 1,149 tokens wide and 1.3M query-key pairs are scored for the 0.27M
that the mask keeps. Attention then costs more than the projections it saved, so the cost model falls back to
plain packing, which recomputes the prompt for every rollout.

Here the row is cut into its segments instead: every segment's queries attend, in one batched SDPA call, to the
keys of the segment it sees (its prefix) followed by its own keys, causally. The scores are [S, H, n, P + n]
(S segments, n the longest segment, P the longest prefix) instead of [R, H, L, L]. The output is the same as the
dense mask's to float rounding (tests/unit/test_span_attention.py), and so are the gradients: the prefix's keys
and values receive the sum of what every segment sends them, as in the dense layout.

transformers looks attention functions up by name in the model config (`AttentionInterface`); `span_attention`
switches the config to this function for a micro-batch's forward and backward (a checkpointed layer's recompute
runs inside the backward, under the same name), and the function hands every call without spans to SDPA.
We write this ourselves because neither transformers nor torch's CPU SDPA has a "shared prefix + own causal
block" pattern; flex_attention expresses it but needs inductor compilation per shape.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F

NAME = "vf_prefix_span"


@dataclasses.dataclass
class PrefixSpans:
    """Gather plan of one micro-batch of shape [R, L] (flat positions index [R * L])."""

    q_index: torch.Tensor  # [S, n] flat position of each segment's query t (padded with the segment's first)
    k_index: torch.Tensor  # [S, P + n] flat positions of its prefix's keys, then its own
    mask: torch.Tensor  # [S, 1, n, P + n] bool: True = attend
    out_index: torch.Tensor  # [Q] flat positions that receive an output (every real token once)
    out_select: torch.Tensor  # [Q] which entries of the flattened [S * n] outputs they are
    shape: tuple[int, int]  # (R, L)

    def to(self, device) -> PrefixSpans:
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k, v in moved.items():
            if isinstance(v, torch.Tensor):
                moved[k] = v.to(device)
        return PrefixSpans(**moved)

    @property
    def pairs(self) -> int:
        """Query-key pairs scored per head (the cost model's attention term)."""
        return int(self.q_index.shape[0] * self.q_index.shape[1] * self.k_index.shape[1])


def spans_from_segments(segments: list[list[int]], sees: list[list[int]], width: int) -> PrefixSpans:
    """The plan for rows of `width` tokens whose real token t of row r belongs to segment `segments[r][t]` and
    also sees segment `sees[r][t]` (itself, or the prefix it shares); padding past each list is left out. A
    segment is a contiguous run of a row, and a prefix stands before the segments that see it."""
    starts, lens, pre_starts, pre_lens = [], [], [], []
    for r, (seg, see) in enumerate(zip(segments, sees)):
        first: dict[int, int] = {}
        count: dict[int, int] = {}
        for t, s in enumerate(seg):
            first.setdefault(s, t)
            count[s] = count.get(s, 0) + 1
        for s, t0 in first.items():
            p = see[t0]
            starts.append(r * width + t0)
            lens.append(count[s])
            shared = p != s and p in first
            pre_starts.append(r * width + (first[p] if shared else t0))
            pre_lens.append(count[p] if shared else 0)
    n, prefix = max(lens), max(pre_lens)
    start, count = torch.tensor(starts)[:, None], torch.tensor(lens)[:, None]
    p_start, p_count = torch.tensor(pre_starts)[:, None], torch.tensor(pre_lens)[:, None]
    t, j = torch.arange(n)[None], torch.arange(prefix)[None]
    q_index = start + torch.minimum(t, count - 1)
    k_index = torch.cat([p_start + torch.minimum(j, (p_count - 1).clamp(min=0)), q_index], dim=1)
    q_ok = t < count  # [S, n]
    sees_prefix = (j < p_count)[:, None, :].expand(-1, n, -1)  # [S, n, P]
    own = (t[:, :, None] >= t[:, None, :]) & q_ok[:, None, :]  # key u <= query t, both real
    mask = torch.cat([sees_prefix, own], dim=2)
    mask[:, :, prefix] |= ~q_ok  # a padded query sees its segment's first key: softmax stays finite, output unused
    return PrefixSpans(
        q_index=q_index,
        k_index=k_index,
        mask=mask[:, None],
        out_index=q_index[q_ok],
        out_select=torch.arange(q_ok.numel())[q_ok.reshape(-1)],
        shape=(len(segments), width),
    )


def span_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention signature: query [B, H, L, D], key/value [B, Hkv, L, D] -> ([B, L, H, D], None)."""
    spans: PrefixSpans | None = kwargs.pop("prefix_spans", None)
    if spans is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    q = query.transpose(1, 2).reshape(batch * length, heads, dim)
    k = key.transpose(1, 2).reshape(batch * length, kv_heads, dim)
    v = value.transpose(1, 2).reshape(batch * length, kv_heads, dim)
    qs = q[spans.q_index].transpose(1, 2)  # [S, H, n, D]
    ks, vs = (x[spans.k_index].transpose(1, 2) for x in (k, v))  # [S, Hkv, P + n, D]
    out = F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=spans.mask, dropout_p=dropout, scale=scaling, enable_gqa=kv_heads != heads
    )
    picked = out.transpose(1, 2).reshape(-1, heads, dim)[spans.out_select]  # [Q, H, D]
    full = query.new_zeros(batch * length, heads, dim).index_copy(0, spans.out_index, picked)
    return full.view(batch, length, heads, dim), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, span_attention_forward)


@contextlib.contextmanager
def span_attention(model):
    """Attention by `PrefixSpans` (passed as the model's `prefix_spans` keyword) inside the block."""
    register()
    while not hasattr(model, "config") and hasattr(model, "module"):  # DDP / DeepSpeed wrappers
        model = model.module
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
