"""Micro-batch planning, padded/packed collation (alignment, boundaries), a tiny-model packed-forward check,
and packed vs padded equivalence of every policy loss."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from verifiers_rl.batch.microbatches import (
    collate_packed,
    collate_padded,
    padding_fraction,
    plan_microbatches,
    plan_rows,
)
from verifiers_rl.batch.samples import Sample
from verifiers_rl.loss.losses import LOSS_TYPES, policy_loss


def _cost(lengths, mb, packed=False):
    return sum(lengths[i] for i in mb) if packed else len(mb) * max(lengths[i] for i in mb)


def _mixed_lengths(seed=0, n=64):
    rng = random.Random(seed)
    return [rng.choice([rng.randint(5, 20), rng.randint(100, 300)]) for _ in range(n)]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("bucket", [False, True])
def test_plan_respects_budget_and_covers_every_index_once(packed, bucket):
    lengths = _mixed_lengths() + [1000]  # one sample over the budget
    plan = plan_microbatches(lengths, 600, bucket_by_length=bucket, packed=packed)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    for mb in plan:
        assert mb and (_cost(lengths, mb, packed) <= 600 or mb == [len(lengths) - 1])
    assert [len(lengths) - 1] in plan
    assert plan == plan_microbatches(list(lengths), 600, bucket_by_length=bucket, packed=packed)


def test_plan_hand_computed():
    assert plan_microbatches([3, 5, 2, 5], 10) == [[1, 3], [0, 2]]  # 2*5, then 2*3
    assert plan_microbatches([3, 5, 2, 5], 10, bucket_by_length=False) == [[0, 1], [2, 3]]  # 2*5, 2*5
    assert plan_microbatches([3, 5, 2, 5], 10, packed=True) == [[1, 3], [0, 2]]
    assert plan_microbatches([4, 4, 4], 100, max_samples=2) == [[0, 1], [2]]
    assert plan_microbatches([], 10) == []
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        plan_microbatches([1], 0)


def _samples(lengths, seed=0, vocab=256):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        prompt = max(1, n // 3)
        mask = [False] * prompt + [True] * (n - prompt)
        if n > 4:
            mask[-2] = False  # an env-response token inside the completion
        out.append(
            Sample(
                input_ids=torch.randint(0, vocab, (n,), generator=gen).tolist(),
                loss_mask=mask,
                sampler_logprobs=[float(-torch.rand(1, generator=gen)) if m else 0.0 for m in mask],
                advantage=float(i) - 1.5,
                rollout=i,
            )
        )
    return out


def test_bucketing_reduces_padding():
    lengths = _mixed_lengths(seed=1)
    samples = _samples(lengths)

    def frac(bucket):
        plan = plan_microbatches(lengths, 1200, bucket_by_length=bucket)
        return padding_fraction([collate_padded([samples[i] for i in mb], 0) for mb in plan])

    assert frac(True) < 0.5 * frac(False)
    assert padding_fraction([]) == 0.0


def test_collate_padded_alignment():
    s = _samples([4, 2])
    s[0].loss_mask = [True, False, True, True]  # token 0 can never be trained
    b = collate_padded(s, pad_token_id=99)
    assert b.input_ids.tolist() == [s[0].input_ids, s[1].input_ids + [99, 99]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert b.target_ids.tolist() == [s[0].input_ids[1:], [s[1].input_ids[1], 99, 99]]
    assert b.loss_mask.tolist() == [[False, True, True], [True, False, False]]
    assert b.sampler_logprobs[0].tolist() == pytest.approx(s[0].sampler_logprobs[1:])
    assert b.advantages.tolist() == [-1.5, -0.5]
    assert (b.num_real_tokens, b.num_padded_tokens, b.num_loss_tokens) == (6, 2, 3)
    assert padding_fraction([b]) == pytest.approx(2 / 8)


def test_collate_packed_boundaries_and_positions():
    s = _samples([3, 4, 2])
    for x in s:
        x.loss_mask = [True] * len(x.input_ids)  # even a fully "trained" sample never trains token 0
    b = collate_packed(s)
    ids = [t for x in s for t in x.input_ids]
    assert b.input_ids.tolist() == [ids] and b.target_ids.tolist() == [ids[1:]]
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 1]]
    # target j describes token j+1; targets 2 and 6 are the first tokens of samples 1 and 2
    assert b.loss_mask.tolist() == [[True, True, False, True, True, True, False, True]]
    assert b.seq_index.tolist() == [[0, 0, 1, 1, 1, 1, 2, 2]]
    assert b.advantages.tolist() == [[-1.5, -1.5, -0.5, -0.5, -0.5, -0.5, 0.5, 0.5]]
    assert b.sampler_logprobs[0, 3:6].tolist() == pytest.approx(s[1].sampler_logprobs[1:])
    assert "attention_mask" not in b.model_inputs()  # the block-diagonal mask comes from position_ids
    assert (b.num_real_tokens, b.num_padded_tokens, b.num_loss_tokens, b.num_sequences) == (9, 0, 6, 3)


def test_microbatch_to_moves_every_tensor_and_keeps_the_counts():
    samples = _samples([5, 3, 4])
    for mb in (collate_padded(samples, 0), collate_packed(samples, row_len=6)):
        moved = mb.to("meta")
        for f in dataclasses.fields(mb):
            before, after = getattr(mb, f.name), getattr(moved, f.name)
            if torch.is_tensor(before):
                assert after.device.type == "meta", f.name
                assert (after.shape, after.dtype) == (before.shape, before.dtype), f.name
                assert before.device.type == "cpu"  # a copy: the micro-batch itself stays where it was
            else:
                assert after == before, f.name


@pytest.mark.parametrize("packed", [False, True])
def test_empty_microbatch_is_marked_and_still_trains_a_target(packed):
    from verifiers_rl.trainer.policy_step import empty_microbatch

    mb = empty_microbatch(packed)
    # one trained target, so its (zero-weighted) loss still reaches every parameter DDP all-reduces
    assert mb.empty and mb.num_loss_tokens == int(mb.loss_mask.sum()) == 1 and mb.num_sequences == 1
    from verifiers_rl.batch.microbatches import PackedBatch, PaddedBatch

    assert isinstance(mb, PackedBatch if packed else PaddedBatch)
    assert not collate_packed(_samples([3])).empty and not collate_padded(_samples([3]), 0).empty


def test_collate_validation():
    s = _samples([3])
    with pytest.raises(ValueError, match="sampler_logprobs"):
        collate_packed([dataclasses.replace(s[0], sampler_logprobs=[0.0])])
    with pytest.raises(ValueError, match="empty"):
        collate_padded([], 0)


@pytest.fixture(scope="module")
def tiny():
    from verifiers_rl.tiny import build_tiny_model

    model, tok = build_tiny_model()
    model.set_attn_implementation("sdpa")
    return model, tok


def _target_logprobs(model, **inputs):
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, inputs["input_ids"][:, 1:, None]).squeeze(-1)


def test_tiny_model_packed_and_padded_match_single_sample(tiny):
    model, tok = tiny
    samples = _samples([7, 12, 3, 9], vocab=len(tok))
    alone = [_target_logprobs(model, input_ids=torch.tensor([x.input_ids]))[0] for x in samples]

    packed = collate_packed(samples)
    lp = _target_logprobs(model, input_ids=packed.input_ids, position_ids=packed.position_ids)[0]
    offset = 0
    for x, ref in zip(samples, alone):
        n = len(x.input_ids)
        torch.testing.assert_close(lp[offset : offset + n - 1], ref, atol=1e-5, rtol=1e-5)
        offset += n
    # without position_ids the samples attend to each other: the check above is not vacuous
    crossed = _target_logprobs(model, input_ids=packed.input_ids)[0]
    assert not torch.allclose(crossed[7:18], alone[1], atol=1e-3)

    padded = collate_padded(samples, tok.pad_token_id)
    lp = _target_logprobs(model, input_ids=padded.input_ids, attention_mask=padded.attention_mask)
    for row, (x, ref) in enumerate(zip(samples, alone)):
        torch.testing.assert_close(lp[row, : len(x.input_ids) - 1], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_policy_loss_packed_equals_padded(loss_type):
    lengths = [6, 3, 9, 5]
    samples = _samples(lengths, seed=3)
    gen = torch.Generator().manual_seed(4)
    # one trainer logprob per token of each sample (index 0 unused); both layouts read the same leaves
    leaves = [(-torch.rand(n, generator=gen)).requires_grad_() for n in lengths]
    refs = [-torch.rand(n, generator=gen) for n in lengths]

    padded = collate_padded(samples, 0)
    t = padded.target_ids.shape[1]
    lp_pad = torch.stack([torch.cat([x[1:], x.new_zeros(t - len(x) + 1)]) for x in leaves])
    ref_pad = torch.stack([torch.cat([x[1:], x.new_zeros(t - len(x) + 1)]) for x in refs])
    packed = collate_packed(samples)
    lp_pack = torch.cat(leaves)[None, 1:]
    ref_pack = torch.cat(refs)[None, 1:]

    kw = dict(
        loss_type=loss_type,
        num_tokens_global=padded.num_loss_tokens,
        num_sequences_global=len(samples),
        max_tokens=10,
        clip_eps_low=0.1,
        clip_eps_high=0.1,
        kl_beta=0.05,
    )
    loss_pad, m_pad = policy_loss(
        lp_pad, padded.sampler_logprobs, padded.advantages, padded.loss_mask, ref_logprobs=ref_pad, **kw
    )
    grads_pad = torch.autograd.grad(loss_pad, leaves)
    loss_pack, m_pack = policy_loss(
        lp_pack,
        packed.sampler_logprobs,
        packed.advantages,
        packed.loss_mask,
        ref_logprobs=ref_pack,
        seq_index=packed.seq_index,
        **kw,
    )
    grads_pack = torch.autograd.grad(loss_pack, leaves)
    assert padded.num_loss_tokens == packed.num_loss_tokens
    torch.testing.assert_close(loss_pack, loss_pad)
    for gp, gq in zip(grads_pack, grads_pad):
        torch.testing.assert_close(gp, gq)
    assert any(g.abs().sum() > 0 for g in grads_pad)
    for k in m_pad:
        torch.testing.assert_close(m_pack[k], m_pad[k])


def test_plan_rows_first_fit_decreasing():
    assert plan_rows([5, 3, 4], None) == [[0, 1, 2]]
    assert plan_rows([5, 3, 4], 12) == [[0, 1, 2]]  # fits in one row
    # longest first: 7 -> row 0; 5 -> row 1; 4 -> row 1 (room 5); 3 -> row 0 (room 3); 20 over the cap: alone
    assert plan_rows([4, 7, 5, 3, 20], 10) == [[4], [1, 3], [0, 2]]
    rows = plan_rows(_mixed_lengths(), 300)
    assert sorted(i for r in rows for i in r) == list(range(64))
    lengths = _mixed_lengths()
    assert all(sum(lengths[i] for i in r) <= 300 or len(r) == 1 for r in rows)


def test_packed_rows_match_single_samples(tiny):
    """Rows capped at row_len: each sample still sees only itself, the pad segment trains nothing."""
    model, tok = tiny
    samples = _samples([7, 12, 3, 9, 5], vocab=len(tok))
    alone = [_target_logprobs(model, input_ids=torch.tensor([x.input_ids]))[0] for x in samples]
    b = collate_packed(samples, row_len=16, pad_token_id=tok.pad_token_id)
    assert b.input_ids.shape[0] > 1 and b.num_padded_tokens > 0
    assert b.num_real_tokens == sum(len(x.input_ids) for x in samples)
    lp = _target_logprobs(model, input_ids=b.input_ids, position_ids=b.position_ids)
    for i, (x, ref) in enumerate(zip(samples, alone)):
        # trained targets of sample i, in order (row-major), against the same targets of the sample alone
        where = (b.seq_index == i) & b.loss_mask
        trained = torch.tensor(x.loss_mask[1:])
        assert int(where.sum()) == int(trained.sum()) > 0
        torch.testing.assert_close(lp[where], ref[trained], atol=1e-5, rtol=1e-5)
    assert int(b.loss_mask.sum()) == b.num_loss_tokens == sum(sum(x.loss_mask[1:]) for x in samples)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_policy_loss_rows_equal_one_row(loss_type):
    samples = _samples([6, 3, 9, 5, 8], seed=5)
    one, rows = collate_packed(samples), collate_packed(samples, row_len=12)
    assert rows.input_ids.shape[0] > 1
    gen = torch.Generator().manual_seed(6)
    lp_one = -torch.rand(one.loss_mask.shape, generator=gen)
    # the same per-target logprob for each (sample, target) in the multi-row layout
    lp_rows = torch.zeros(rows.loss_mask.shape)
    for i in range(len(samples)):
        lp_rows[(rows.seq_index == i) & rows.loss_mask] = lp_one[(one.seq_index == i) & one.loss_mask]
    kw = dict(
        loss_type=loss_type,
        num_tokens_global=one.num_loss_tokens,
        num_sequences_global=len(samples),
        max_tokens=10,
        clip_eps_low=0.1,
        clip_eps_high=0.1,
    )
    loss_one, m_one = policy_loss(
        lp_one, one.sampler_logprobs, one.advantages, one.loss_mask, seq_index=one.seq_index, **kw
    )
    loss_rows, m_rows = policy_loss(
        lp_rows, rows.sampler_logprobs, rows.advantages, rows.loss_mask, seq_index=rows.seq_index, **kw
    )
    torch.testing.assert_close(loss_rows, loss_one)
    for k in m_one:
        torch.testing.assert_close(m_rows[k], m_one[k])
