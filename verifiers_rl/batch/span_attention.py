"""Shared-prompt attention by span: each segment of a shared-prompt row attends to its prefix and itself only.

prefix_sharing.py lays a group out as one row `[prefix | suffix_1 | ... | suffix_G]` with a dense [L, L] mask.
SDPA then scores every query against every key of the row and throws most of it away: at 8 rollouts of 128
tokens behind a 125-token prompt, a row is 1,149 tokens wide and 1.3M query-key pairs are scored for the 0.27M
that the mask keeps. Attention then costs more than the projections it saved, so the cost model falls back to
plain packing, which recomputes the prompt for every rollout.

Here the row is cut into its segments instead, and the segments into query blocks of one size c (the longest
rollout, so that the prompt's segment does not pad every rollout's queries to its length): every block's queries
attend, in one batched SDPA call, to its context (the prefix it sees, then its own segment's earlier tokens) and
to itself, causally. The scores are [B, H, c, C + c] (B blocks, C the longest context) instead of [R, H, L, L]:
0.09M pairs per group instead of 0.26M at 8 rollouts of 48 tokens behind 125 prompt tokens. The output is the
dense mask's to float rounding (tests/unit/test_prefix_sharing.py), and so are the gradients: the prefix's keys
and values receive the sum of what every block sends them, as in the dense layout. The price is memory: each
block gathers its own copy of its context's keys and values, which SDPA keeps for the backward, about
(prompt + c) / c times the layer's K/V activations (2-4x at the RL shapes this runs on; the dense layout's
[R, 1, L, L] mask instead grows with the row squared).

transformers looks attention functions up by name in the model config (`AttentionInterface`); `span_attention`
switches the config to this function for a micro-batch's forward and backward (a checkpointed layer's recompute
runs inside the backward, under the same name), and the function hands every call without spans to SDPA.
We write this ourselves because neither transformers nor torch's CPU SDPA has a "shared prefix + own causal
block" pattern; flex_attention expresses it but needs inductor compilation per shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F

NAME = "vf_prefix_span"


@dataclasses.dataclass
class PrefixSpans:
    """Gather plan of one micro-batch of shape [R, L] (flat positions index [R * L])."""

    q_index: torch.Tensor  # [B, c] flat position of each query block's query t (padding repeats its last)
    k_index: torch.Tensor  # [B, C + c] flat positions of its context keys (prefix, earlier own), then its own
    mask: torch.Tensor  # [B, 1, c, C + c] bool: True = attend
    out_index: torch.Tensor  # [Q] flat positions that receive an output (every real token once)
    out_select: torch.Tensor  # [Q] which entries of the flattened [B * c] outputs they are
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


def query_blocks(segments: Sequence[tuple[int, int]]) -> tuple[int, list[tuple[int, int, int, int]]]:
    """Cut segments, given as (tokens, prefix tokens), into query blocks of one size `c`, so that one long segment
    (a group's prompt) does not pad every other segment's queries to its length: block (segment, offset a, tokens,
    context) attends to `context` = prefix + a keys before it, then to its own tokens causally. `c` is the
    longest segment that has a prefix (a rollout), else the longest segment. Returns (c, blocks)."""
    suffixes = [n for n, p in segments if p]
    c = max(suffixes) if suffixes else max(n for n, _ in segments)
    return c, [(s, a, min(c, n - a), p + a) for s, (n, p) in enumerate(segments) for a in range(0, n, c)]


def block_pairs(segments: Sequence[tuple[int, int]]) -> int:
    """Query-key pairs one head scores for these segments (the cost model's attention term)."""
    c, blocks = query_blocks(segments)
    return len(blocks) * c * (max(ctx for *_, ctx in blocks) + c)


def spans_from_segments(segments: list[list[int]], sees: list[list[int]], width: int) -> PrefixSpans:
    """The plan for rows of `width` tokens whose real token t of row r belongs to segment `segments[r][t]` and
    also sees segment `sees[r][t]` (itself, or the prefix it shares); padding past each list is left out. A
    segment is a contiguous run of a row, and a prefix stands before the segments that see it."""
    spans = []  # (flat start, tokens, flat start of its prefix, prefix tokens)
    for r, (seg, see) in enumerate(zip(segments, sees)):
        first: dict[int, int] = {}
        count: dict[int, int] = {}
        for t, s in enumerate(seg):
            first.setdefault(s, t)
            count[s] = count.get(s, 0) + 1
        for s, t0 in first.items():
            p = see[t0]
            shared = p != s and p in first
            spans.append((r * width + t0, count[s], r * width + first[p] if shared else 0, count[p] if shared else 0))
    c, blocks = query_blocks([(n, p) for _, n, _, p in spans])
    ctx_max = max(ctx for *_, ctx in blocks)
    q_rows, ctx_rows, lens, ctxs = [], [], [], []
    for s, a, n, ctx in blocks:
        start, _, p_start, p = spans[s]
        q_rows.append([start + a + min(t, n - 1) for t in range(c)])
        keys = [*range(p_start, p_start + p), *range(start, start + a)]
        ctx_rows.append(keys + [start] * (ctx_max - len(keys)))
        lens.append(n)
        ctxs.append(ctx)
    q_index = torch.tensor(q_rows)
    k_index = torch.cat([torch.tensor(ctx_rows, dtype=torch.long).reshape(len(blocks), ctx_max), q_index], dim=1)
    t = torch.arange(c)
    n, ctx = torch.tensor(lens)[:, None], torch.tensor(ctxs)[:, None]
    q_ok = t[None] < n  # [B, c]
    sees_context = (torch.arange(ctx_max)[None] < ctx)[:, None, :].expand(-1, c, -1)
    own = (t[:, None] >= t[None, :])[None] & q_ok[:, None, :]  # key u <= query t, both real (u = 0 always is)
    mask = torch.cat([sees_context, own], dim=2)
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
    # DDP's wrapper has no config, DeepSpeed's engine has its own (a dict): the model's is inside
    while not hasattr(getattr(model, "config", None), "_attn_implementation") and hasattr(model, "module"):
        model = model.module
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
