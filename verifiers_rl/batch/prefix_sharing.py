"""Shared-prompt micro-batches: each group's prompt is forwarded once, its rollouts attend to it (pure functions).

The rollouts of a group start with the same prompt tokens. Packed one sample per segment, every rollout
recomputes that prompt: at 8 rollouts of ~90 prompt + 30 completion tokens, three quarters of the
forward/backward is the same prompt eight times. Here a group becomes one *unit* laid out as

    [prefix | suffix_1 | suffix_2 | ... | suffix_G]

where the prefix is the tokens all of its samples share, computed once, and suffix i is the rest of sample i: its
positions continue from the prefix, and a 4D mask lets it see the prefix and itself (causally), nothing else. The
gradient reaching the shared prefix is the sum of what each sample sends through its own copy in the unshared
layout, so loss and gradients equal that layout's up to float rounding (tests/unit/test_prefix_sharing.py).
The same idea is published as "Prefix Grouper" (shared-prefix forward for GRPO, 2025).

The prefix ends one token before the first trained token of any sample: the hidden state at the prefix's last
position would predict a token that differs per sample, so that position starts every suffix instead. Needs an
attention that takes an arbitrary dense mask (SDPA, eager); flash-attention's varlen kernels cannot express
"attend to another segment", so the trainer keeps plain packing there (policy_step.microbatches), and also
wherever the cost model below says sharing costs more (long completions make a unit's dense mask large).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verifiers_rl.batch.microbatches import (
    SharedPromptBatch,
    _untrain_first_token,
    _validate,
    packed_tensors,
    plan_rows,
)
from verifiers_rl.batch.samples import Sample

# (sample indices, shared prefix length): the samples of one unit, in order
Unit = tuple[list[int], int]


def first_trained(loss_mask: Sequence[bool]) -> int:
    """Index of the first trained target token (token 0 never is); len(loss_mask) when none is."""
    return next((t for t in range(1, len(loss_mask)) if loss_mask[t]), len(loss_mask))


def shared_prefix_len(samples: Sequence[Sample]) -> int:
    """Tokens the samples can share: their common prefix, stopped one before the first trained token of any.

    0 for fewer than two samples (nothing to share)."""
    if len(samples) < 2:
        return 0
    first = samples[0].input_ids
    n = min(first_trained(s.loss_mask) - 1 for s in samples)
    n = min(n, *(len(s.input_ids) - 1 for s in samples))
    common = 0
    while common < n and all(s.input_ids[common] == first[common] for s in samples):
        common += 1
    return common


def unit_length(lengths: Sequence[int], prefix: int) -> int:
    """Tokens a unit computes: the prefix once, then every sample's rest."""
    return prefix + sum(n - prefix for n in lengths)


def plan_units(samples: Sequence[Sample], max_samples: int | None, max_tokens: int) -> list[Unit]:
    """Samples grouped by their `group` key (None: a unit of its own), split so that no unit holds more than
    `max_samples` samples or computes more than `max_tokens` tokens (a single longer sample is its own unit)."""
    groups: dict[object, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(("alone", i) if s.group is None else s.group, []).append(i)
    units: list[Unit] = []
    for idx in groups.values():
        prefix = shared_prefix_len([samples[i] for i in idx])
        chunk: list[int] = []
        for i in idx:
            grown = [len(samples[j].input_ids) for j in (*chunk, i)]
            full = max_samples is not None and len(chunk) >= max_samples
            if chunk and (full or unit_length(grown, prefix) > max_tokens):
                units.append((chunk, shared_prefix_len([samples[j] for j in chunk])))
                chunk = []
            chunk.append(i)
        units.append((chunk, shared_prefix_len([samples[j] for j in chunk])))
    return units


def attention_mask(segment: torch.Tensor, sees: torch.Tensor) -> torch.Tensor:
    """[R, 1, L, L] bool (True = attend): query q sees key k <= q of its own segment or of segment `sees[q]`."""
    length = segment.shape[1]
    pos = torch.arange(length)
    causal = (pos[:, None] >= pos[None, :])[None]
    own = segment[:, :, None] == segment[:, None, :]
    prefix = segment[:, None, :] == sees[:, :, None]
    return (causal & (own | prefix))[:, None]


def collate_shared(
    samples: Sequence[Sample],
    units: Sequence[Unit],
    row_len: int | None = None,
    pad_token_id: int = 0,
) -> SharedPromptBatch:
    """Units laid out as [prefix | suffixes...] in rows of at most `row_len` tokens, with a 4D attention mask,

    Tensors as `microbatches.collate_packed` (per-target tensors shifted by one, seq_index for the loss) plus
    `attention_mask` [R, 1, L, L] (bool, True = attend) and `num_shared_tokens` (prompt tokens not recomputed).
    Pass the mask as is to an SDPA model (eager wants it additive: `additive_mask`). Every segment's first
    token is an untrained target (it follows another segment in the row), which the prefix's end guarantees.
    """
    _validate(samples)
    lengths = [unit_length([len(samples[i].input_ids) for i in idx], p) for idx, p in units]
    rows = []
    for row_units in plan_rows(lengths, row_len):
        ids, pos, mask, sampler, adv, seq, seg, sees = [], [], [], [], [], [], [], []
        for u in row_units:
            idx, p = units[u]
            head = samples[idx[0]]
            prefix_seg = max(seg, default=-1) + 1  # used only when there is a prefix
            if p:
                ids += head.input_ids[:p]
                pos += range(p)
                mask += [False] * p
                sampler += [0.0] * p
                adv += [0.0] * p
                seq += [idx[0]] * p
                seg += [prefix_seg] * p
                sees += [prefix_seg] * p
            for i in idx:
                s = samples[i]
                n = len(s.input_ids)
                own = max(seg, default=-1) + 1
                ids += s.input_ids[p:]
                pos += range(p, n)
                mask += _untrain_first_token(s.loss_mask[p:])
                sampler += s.sampler_logprobs[p:]
                adv += [float(s.advantage)] * (n - p)
                seq += [i] * (n - p)
                seg += [own] * (n - p)
                sees += [prefix_seg if p else own] * (n - p)
        rows.append([ids, pos, mask, sampler, adv, seq, seg, sees])
    real = sum(len(r[0]) for r in rows)
    mb = packed_tensors(rows, pad_token_id, len(samples), SharedPromptBatch)
    width = mb.input_ids.shape[1]
    mb.num_shared_tokens = sum(len(s.input_ids) for s in samples) - real
    for *_, seg, sees in rows:  # padding is a segment of its own: it attends to itself
        pad_seg = max(seg) + 1
        sees += [pad_seg] * (width - len(seg))
        seg += [pad_seg] * (width - len(seg))
    seg, sees = (torch.tensor([r[k] for r in rows]) for k in (6, 7))
    mb.attention_mask = attention_mask(seg, sees)
    return mb


def additive_mask(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A bool attention mask as eager attention adds it to the scores: 0 where seen, the dtype's min elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)


# ------------------------------------------------------------------------------------------------ cost model


def layer_costs(config) -> tuple[float, float]:
    """(FLOPs per token of one layer's projections, FLOPs per attended query-key pair of one layer) for a
    decoder config; the ratio is what decides a layout, so layers and the backward's multiple cancel."""
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    if not hidden:
        return 1.0, 0.0
    heads = int(getattr(config, "num_attention_heads", 0) or 1)
    head_dim = int(getattr(config, "head_dim", 0) or hidden // heads)
    kv = int(getattr(config, "num_key_value_heads", 0) or heads)
    ffn = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    params = hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * ffn
    return 2.0 * params, 4.0 * heads * head_dim


def rows_cost(rows: int, width: int, per_token: float, per_pair: float) -> float:
    """Cost of an [rows, width] micro-batch under a dense mask (SDPA scores every query-key pair of a row)."""
    return rows * width * per_token + rows * width * width * per_pair


def _rows(sizes: Sequence[int]) -> tuple[int, int]:
    """(rows, width) of items first-fit into rows as wide as the widest item, as the collators lay them out."""
    rows = plan_rows(sizes, max(sizes))
    return len(rows), max(sum(sizes[i] for i in r) for r in rows)


def plan_cost(plan: Sequence[Sequence[int]], lengths: Sequence[int], per_token: float, per_pair: float) -> float:
    """Estimated cost of micro-batches of items (samples or units) laid out as the collators do without a
    varlen kernel: first-fit rows as wide as the widest item, each micro-batch padded to its widest row."""
    total = 0.0
    for mb in plan:
        total += rows_cost(*_rows([lengths[i] for i in mb]), per_token, per_pair)
    return total
