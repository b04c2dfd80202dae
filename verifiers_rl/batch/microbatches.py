"""Training samples -> micro-batches: planning under a token budget, then padded or packed collation.

Samples are `samples.Sample`s (per-token lists aligned with their tokens). A micro-batch is a `MicroBatch`: the
tensors of one forward/backward pass, in one of three layouts. Padded (`PaddedBatch`): one sample per row, [B, T]
with T the longest sample. Packed (`PackedBatch`): samples concatenated into rows, [R, L], positions restarting
at each sample; `SharedPromptBatch` (prefix_sharing.py) packs a group's prompt once.

Alignment (both layouts): the logits at position t predict token t+1, so every per-target tensor is shifted
by one against `input_ids`: index j of `target_ids`, `loss_mask`, `sampler_logprobs` (and, packed,
`advantages`, `seq_index`) describes token j+1, scored with the logits / final hidden state at position j:

    logp[:, j] = log_softmax(logits[:, j])[target_ids[:, j]],   logits = model(...).logits[:, :-1]

A sample's token 0 has no context and is never trained, whatever its loss_mask says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verifiers_rl.batch.samples import Sample

_LISTS = ("loss_mask", "sampler_logprobs")  # per-token lists that must be as long as input_ids


@dataclass(kw_only=True)
class MicroBatch:
    """One forward/backward pass, in one of three layouts (`PaddedBatch`, `PackedBatch`, `SharedPromptBatch`).
    What every layout holds: [N, W] token ids (N rows of width W) and the per-target [N, W-1] tensors."""

    input_ids: torch.Tensor  # [N, W] long; pad slots hold the pad token
    target_ids: torch.Tensor  # [N, W-1] long: input_ids[:, 1:]
    loss_mask: torch.Tensor  # [N, W-1] bool: targets to train (never a sample's first token, never padding)
    sampler_logprobs: torch.Tensor  # [N, W-1] float32: the engine's logprob of each target, NaN where none exists
    advantages: torch.Tensor  # float32, per layout: [B] one per row (padded) or [R, W-1] per target (packed)
    num_real_tokens: int  # tokens of the samples
    num_padded_tokens: int  # pad slots: rows * width - num_real_tokens
    num_loss_tokens: int  # trained targets
    num_sequences: int  # samples
    num_shared_tokens: int = 0  # shared prompt tokens not recomputed (SharedPromptBatch only)
    empty: bool = False  # a zero-weight pass for a rank with fewer micro-batches than the others (DDP)

    def model_inputs(self) -> dict:
        """The model's keyword arguments of this layout (no `logits_to_keep`: the forward chooses it)."""
        return {"input_ids": self.input_ids}

    def sample_of_target(self) -> torch.Tensor | None:
        """[R, W-1] long, the sample each target belongs to, where a row holds several samples; None otherwise."""
        return None

    def to(self, device: torch.device | str) -> MicroBatch:
        """A copy with every tensor on `device` (the counts stay Python ints)."""
        moved = {
            f.name: value.to(device)
            for f in dataclasses.fields(self)
            if torch.is_tensor(value := getattr(self, f.name))
        }
        return dataclasses.replace(self, **moved)


@dataclass(kw_only=True)
class PaddedBatch(MicroBatch):
    """One sample per row, right-padded to the longest: [B, T]; `advantages` is [B]."""

    attention_mask: torch.Tensor  # [B, T] long, 1 on tokens

    def model_inputs(self) -> dict:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}


@dataclass(kw_only=True)
class PackedBatch(MicroBatch):
    """Samples concatenated into rows: [R, L], positions restarting at each sample (the model derives a
    block-diagonal mask from them); `advantages` is [R, L-1], per target."""

    position_ids: torch.Tensor  # [R, L] long, restarting at 0 with each sample
    seq_index: torch.Tensor  # [R, L-1] long, the sample of each target (the loss's per-sample terms read it)

    def model_inputs(self) -> dict:
        return {"input_ids": self.input_ids, "position_ids": self.position_ids}

    def sample_of_target(self) -> torch.Tensor:
        return self.seq_index


@dataclass(kw_only=True)
class SharedPromptBatch(PackedBatch):
    """A group's prompt once, its rollouts after it (prefix_sharing.py): packed, and each rollout attends to the
    prompt and itself through a 4D mask."""

    attention_mask: torch.Tensor | None = None  # [R, 1, L, L] bool (True = attend), or additive (eager)

    def model_inputs(self) -> dict:
        return {**super().model_inputs(), "attention_mask": self.attention_mask}


def plan_microbatches(
    lengths: list[int],
    max_tokens_per_microbatch: int,
    *,
    bucket_by_length: bool = True,
    packed: bool = False,
    max_samples: int | None = None,
    sizes: Sequence[int] | None = None,
) -> list[list[int]]:
    """Greedy partition of sample indices into micro-batches whose cost stays <= the budget.

    cost(mb) = len(mb) * max_{i in mb} lengths[i]   (padded)   or   sum_{i in mb} lengths[i]   (packed).
    A sample longer than the budget on its own gets a micro-batch to itself; `max_samples` also caps the
    samples per micro-batch (item i stands for `sizes[i]` samples when given: a shared-prompt unit). With
    bucketing, samples are visited longest first (ties by index), so neighbours have similar lengths and
    padding stays small; the longest micro-batch also comes first, so an out-of-memory shows at the start of
    a step, not the end.
    """
    if max_tokens_per_microbatch < 1:
        raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {max_tokens_per_microbatch}")
    if any(n < 0 for n in lengths):
        raise ValueError("lengths must be >= 0")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be >= 1 or None, got {max_samples}")
    order = range(len(lengths))
    if bucket_by_length:
        order = sorted(order, key=lambda i: (-lengths[i], i))
    plan: list[list[int]] = []
    current: list[int] = []
    longest = total = count = 0
    for i in order:
        n, size = lengths[i], (sizes[i] if sizes is not None else 1)
        cost = total + n if packed else (len(current) + 1) * max(longest, n)
        full = max_samples is not None and count + size > max_samples
        if current and (cost > max_tokens_per_microbatch or full):
            plan.append(current)
            current, longest, total, count = [], 0, 0, 0
        current.append(i)
        longest, total, count = max(longest, n), total + n, count + size
    if current:
        plan.append(current)
    return plan


def _validate(samples: Sequence[Sample]) -> None:
    if not samples:
        raise ValueError("samples must not be empty")
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        if n == 0:
            raise ValueError(f"sample {i} has no input_ids")
        for key in _LISTS:
            if len(getattr(s, key)) != n:
                raise ValueError(f"sample {i}: len({key})={len(getattr(s, key))} != len(input_ids)={n}")


def _untrain_first_token(loss_mask: list[bool]) -> list[bool]:
    return [False, *map(bool, loss_mask[1:])]


def collate_padded(samples: Sequence[Sample], pad_token_id: int) -> PaddedBatch:
    """Right-padded [B, T] batch (T = longest sample) with its [B, T] attention_mask and [B] advantages."""
    _validate(samples)
    b, t = len(samples), max(len(s.input_ids) for s in samples)
    input_ids = torch.full((b, t), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(b, t, dtype=torch.long)
    loss_mask = torch.zeros(b, t, dtype=torch.bool)
    sampler = torch.zeros(b, t, dtype=torch.float32)
    for row, s in enumerate(samples):
        n = len(s.input_ids)
        input_ids[row, :n] = torch.tensor(s.input_ids, dtype=torch.long)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(_untrain_first_token(s.loss_mask), dtype=torch.bool)
        sampler[row, :n] = torch.tensor(s.sampler_logprobs, dtype=torch.float32)
    real = int(attention_mask.sum())
    return PaddedBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        target_ids=input_ids[:, 1:],
        loss_mask=loss_mask[:, 1:],
        sampler_logprobs=sampler[:, 1:],
        advantages=torch.tensor([float(s.advantage) for s in samples], dtype=torch.float32),
        num_real_tokens=real,
        num_padded_tokens=b * t - real,
        num_loss_tokens=int(loss_mask.sum()),
        num_sequences=b,
    )


def plan_rows(lengths: Sequence[int], row_len: int | None) -> list[list[int]]:
    """First-fit-decreasing bins of sample indices whose lengths add up to <= row_len (None: one row).

    A sample longer than row_len gets a row to itself. Rows keep their samples in index order.
    """
    if row_len is None or sum(lengths) <= row_len:
        return [list(range(len(lengths)))]
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        j = next((r for r, free in enumerate(room) if lengths[i] <= free), None)
        if j is None:
            rows.append([i])
            room.append(row_len - lengths[i])
        else:
            rows[j].append(i)
            room[j] -= lengths[i]
    return [sorted(r) for r in rows]


def collate_packed(samples: Sequence[Sample], row_len: int | None = None, pad_token_id: int = 0) -> PackedBatch:
    """Samples concatenated into rows of at most `row_len` tokens (None: all in one row), no attention_mask.

    `position_ids` restart at 0 for each sample; transformers turns that into a block-diagonal causal mask
    (SDPA/eager) or varlen kernels (flash-attention), but only with attention_mask=None and no KV cache, so
    call the model with use_cache=False. A dense block-diagonal mask costs (row length)^2, which is why rows are
    capped when the attention has no varlen kernel; shorter rows are padded with a segment of their own
    (positions restart, never trained). `position_ids` [R, L]; per target [R, L-1]: advantages, and seq_index
    (the sample of each target, global over rows) for `losses.policy_loss`. The position before each sample
    start is never trained: sample starts are untrained targets.
    """
    _validate(samples)
    rows = []
    for idx in plan_rows([len(s.input_ids) for s in samples], row_len):
        ids, pos, mask, sampler, adv, seq = [], [], [], [], [], []
        for i in idx:
            s = samples[i]
            n = len(s.input_ids)
            ids += s.input_ids
            pos += range(n)
            mask += _untrain_first_token(s.loss_mask)
            sampler += s.sampler_logprobs
            adv += [float(s.advantage)] * n
            seq += [i] * n
        rows.append((ids, pos, mask, sampler, adv, seq))
    return packed_tensors(rows, pad_token_id, len(samples))


def packed_tensors(
    rows: Sequence[Sequence[list]], pad_token_id: int, num_sequences: int, layout: type[PackedBatch] = PackedBatch
) -> PackedBatch:
    """Rows of per-token lists (ids, positions, loss mask, sampler logprobs, advantages, sample index; a row may
    carry more lists after these) -> the packed micro-batch tensors, per-target ones shifted by one (module
    docstring). Shorter rows are padded in place to the widest with a segment of their own (positions restart,
    never trained)."""
    width = max(len(r[0]) for r in rows)
    real = sum(len(r[0]) for r in rows)
    for ids, pos, mask, sampler, adv, seq, *_ in rows:
        pad = width - len(ids)
        ids += [pad_token_id] * pad
        pos += range(pad)
        mask += [False] * pad
        sampler += [0.0] * pad
        adv += [0.0] * pad
        seq += [seq[-1]] * pad  # any valid id: these targets are untrained
    ids, pos, mask, sampler, adv, seq = (list(col) for col in zip(*(r[:6] for r in rows)))
    loss_mask = torch.tensor(mask, dtype=torch.bool)
    input_ids = torch.tensor(ids, dtype=torch.long)
    return layout(
        input_ids=input_ids,
        position_ids=torch.tensor(pos, dtype=torch.long),
        target_ids=input_ids[:, 1:],
        loss_mask=loss_mask[:, 1:],
        sampler_logprobs=torch.tensor(sampler, dtype=torch.float32)[:, 1:],
        advantages=torch.tensor(adv, dtype=torch.float32)[:, 1:],
        seq_index=torch.tensor(seq, dtype=torch.long)[:, 1:],
        num_real_tokens=real,
        num_padded_tokens=len(rows) * width - real,
        num_loss_tokens=int(loss_mask[:, 1:].sum()),
        num_sequences=num_sequences,
    )


def padding_fraction(batches: Sequence[MicroBatch]) -> float:
    """Pad slots / all slots over collated batches (0.0 for none): the compute a layout wastes."""
    pad = sum(b.num_padded_tokens for b in batches)
    total = pad + sum(b.num_real_tokens for b in batches)
    return pad / total if total else 0.0
