"""Shared-prompt micro-batches: prefix length, unit planning, the [prefix | suffixes] layout and its mask, equal
logprobs / loss / LoRA gradients against plain packing on the tiny model (SDPA and eager), and the cost model
that decides between the two layouts."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from peft_models import lora_model

from verifiers_rl.batch.microbatches import collate_packed
from verifiers_rl.batch.prefix_sharing import (
    additive_mask,
    collate_shared,
    layer_costs,
    plan_cost,
    plan_units,
    rows_cost,
    shared_prefix_len,
    unit_length,
)
from verifiers_rl.batch.samples import Sample
from verifiers_rl.loss.forward import token_logprobs
from verifiers_rl.loss.losses import LOSS_TYPES, policy_loss
from verifiers_rl.sync.export import ReplicatedExport


def _sample(prompt, completion, group=0, advantage=1.0, trained=None):
    ids = list(prompt) + list(completion)
    mask = [False] * len(prompt) + (list(trained) if trained is not None else [True] * len(completion))
    rng = random.Random(len(ids) * 31 + sum(ids))
    logps = [-rng.random() if m else 0.0 for m in mask]
    return Sample(ids, mask, logps, advantage=advantage, rollout=0, group=group)


def _groups(seed=0, vocab=250):
    """Three groups of rollouts (different prompt and completion lengths), a two-turn group whose second-turn
    samples carry a longer prompt, and a sample alone (no group)."""
    rng = random.Random(seed)
    toks = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    out = []
    for g, (p, k) in enumerate(((20, 4), (9, 3), (14, 2))):
        prompt = toks(p)
        out += [_sample(prompt, toks(rng.randint(2, 8)), g, rng.gauss(0, 1)) for _ in range(k)]
    prompt = toks(11)
    first = [toks(4) for _ in range(2)]
    for c in first:  # turn 1, then turn 2 (its prompt: turn 1 + an environment reply), one group
        out.append(_sample(prompt, c, 3, 0.7))
        out.append(_sample(prompt + c + toks(3), toks(5), 3, 0.7))
    alone = _sample(toks(6), toks(4), advantage=-0.4)
    alone.group = None
    return out + [alone]


def test_shared_prefix_len_stops_before_the_first_trained_token():
    a = _sample([1, 2, 3, 4], [5, 6])
    b = _sample([1, 2, 3, 4], [7, 8, 9])
    assert shared_prefix_len([a, b]) == 3  # position 3 predicts each sample's first completion token
    assert shared_prefix_len([a]) == 0
    assert shared_prefix_len([a, _sample([1, 2, 9, 4], [5])]) == 2  # common prefix shorter than the prompt
    assert shared_prefix_len([a, _sample([8, 2, 3, 4], [5])]) == 0
    # completions that start alike still share nothing past the prompt: those tokens are trained
    assert shared_prefix_len([a, _sample([1, 2, 3, 4], [5, 9])]) == 3
    # an untrained completion token (an environment reply) counts as prompt for the first trained one
    c = _sample([1, 2, 3, 4], [5, 6, 7], trained=[False, True, True])
    d = _sample([1, 2, 3, 4], [5, 6, 8], trained=[False, True, True])
    assert shared_prefix_len([c, d]) == 4


def test_plan_units_cover_every_sample_and_respect_the_caps():
    samples = _groups()
    units = plan_units(samples, None, 10_000)
    assert sorted(i for idx, _ in units for i in idx) == list(range(len(samples)))
    assert [len(idx) for idx, _ in units] == [4, 3, 2, 4, 1]
    assert [p for _, p in units] == [19, 8, 13, 10, 0]
    lengths = [len(s.input_ids) for s in samples]
    for max_samples, max_tokens in ((2, 10_000), (None, 40), (3, 30)):
        units = plan_units(samples, max_samples, max_tokens)
        assert sorted(i for idx, _ in units for i in idx) == list(range(len(samples)))
        for idx, p in units:
            assert max_samples is None or len(idx) <= max_samples
            assert unit_length([lengths[i] for i in idx], p) <= max_tokens or len(idx) == 1
            assert len({("alone", i) if samples[i].group is None else samples[i].group for i in idx}) == 1


def test_collate_shared_layout_by_hand():
    a = _sample([1, 2, 3], [4, 5], advantage=2.0)
    b = _sample([1, 2, 3], [6], advantage=-1.0)
    c = _sample([9, 8], [7], group=1, advantage=0.5)
    mb = collate_shared([a, b, c], [([0, 1], 2), ([2], 0)], pad_token_id=0)
    # one row: prefix [1 2], suffix a [3 4 5], suffix b [3 6], then c alone [9 8 7]
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 3, 6, 9, 8, 7]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3, 0, 1, 2]]
    # targets are tokens 1.. of the row; trained: a's 4 and 5, b's 6, c's 7 (never a segment's first token)
    assert mb.loss_mask.tolist() == [[False, False, True, True, False, True, False, False, True]]
    assert mb.seq_index[0, [2, 3, 5, 8]].tolist() == [0, 0, 1, 2]
    assert mb.advantages[0, [2, 3, 5, 8]].tolist() == [2.0, 2.0, -1.0, 0.5]
    assert mb.sampler_logprobs[0, [2, 3]].tolist() == pytest.approx(a.sampler_logprobs[3:5])
    seen = mb.attention_mask[0, 0]
    rows = {q: [k for k in range(10) if seen[q, k]] for q in range(10)}
    assert rows[1] == [0, 1]  # the prefix, causal
    assert rows[4] == [0, 1, 2, 3, 4]  # suffix a: prefix + itself
    assert rows[6] == [0, 1, 5, 6]  # suffix b: prefix + itself, not suffix a
    assert rows[9] == [7, 8, 9]  # c: only itself
    assert (mb.num_real_tokens, mb.num_padded_tokens, mb.num_loss_tokens) == (10, 0, 4)
    assert mb.num_shared_tokens == 2 and mb.num_sequences == 3
    add = additive_mask(mb.attention_mask)
    assert add[0, 0, 6, 5] == 0 and add[0, 0, 6, 3] == torch.finfo(torch.float32).min


@pytest.fixture(scope="module")
def policy():
    model = lora_model(seed=1)
    model.train()
    return model


def _trained_logprobs(model, mb):
    lp, _ = token_logprobs(model, ReplicatedExport(model), mb, temperature=0.8)
    return lp


def _by_sample(mb, values, n):
    return [values[(mb.seq_index == i) & mb.loss_mask] for i in range(n)]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_logprobs_equal_plain_packing(policy, attn):
    samples = _groups()
    policy.base_model.model.set_attn_implementation(attn)
    try:
        plain = collate_packed(samples)
        units = plan_units(samples, None, 10_000)
        for row_len in (None, 40):  # one row, and units first-fit into several rows
            shared = collate_shared(samples, units, row_len)
            if attn == "eager":
                shared.attention_mask = additive_mask(shared.attention_mask)
            assert shared.num_shared_tokens == 19 * 3 + 8 * 2 + 13 + 10 * 3
            assert shared.num_loss_tokens == plain.num_loss_tokens
            with torch.no_grad():
                ref = _by_sample(plain, _trained_logprobs(policy, plain), len(samples))
                got = _by_sample(shared, _trained_logprobs(policy, shared), len(samples))
            for r, g in zip(ref, got):
                assert r.numel() > 0
                torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
        # the mask is what makes it right: without it every suffix also sees the suffixes before it
        shared = collate_shared(samples, units)
        shared.attention_mask = None
        with torch.no_grad():
            crossed = _by_sample(shared, _trained_logprobs(policy, shared), len(samples))
        assert not torch.allclose(crossed[1], ref[1], atol=1e-3)
    finally:
        policy.base_model.model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_shared_loss_and_lora_gradients_equal_plain(policy, loss_type):
    samples = _groups(seed=2)
    plain = collate_packed(samples)
    with torch.no_grad():  # sampler logprobs near the policy's, so ratios stay inside the clip and mask ranges
        current = _by_sample(plain, _trained_logprobs(policy, plain), len(samples))
    rng = random.Random(3)
    for s, lp in zip(samples, current):
        at = [t for t in range(1, len(s.loss_mask)) if s.loss_mask[t]]
        for t, x in zip(at, lp.tolist()):
            s.sampler_logprobs[t] = x + rng.gauss(0, 0.1)
    plain = collate_packed(samples)
    shared = collate_shared(samples, plan_units(samples, None, 10_000))
    kw = dict(
        loss_type=loss_type,
        num_tokens_global=plain.num_loss_tokens,
        num_sequences_global=len(samples),
        max_tokens=16,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
    )
    results = []
    for mb in (plain, shared):
        policy.zero_grad()
        lp = _trained_logprobs(policy, mb)
        loss, metrics = policy_loss(lp, mb.sampler_logprobs, mb.advantages, mb.loss_mask, seq_index=mb.seq_index, **kw)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}
        results.append((loss.detach(), metrics, grads))
    (loss_a, m_a, g_a), (loss_b, m_b, g_b) = results
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-5)
    for k in m_a:
        torch.testing.assert_close(torch.as_tensor(m_b[k]), torch.as_tensor(m_a[k]), atol=1e-5, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in g_a.values())
    for n in g_a:
        scale = float(g_a[n].abs().max()) + 1e-12
        assert float((g_b[n] - g_a[n]).abs().max()) / scale < 1e-4, n


def test_cost_model():
    assert rows_cost(2, 10, 3.0, 0.5) == 2 * 10 * 3.0 + 2 * 100 * 0.5
    # two items of 6 and 4 fit one row as wide as the widest (6)? no: 10 > 6, so two rows of width 6
    assert plan_cost([[0, 1]], [6, 4], 1.0, 0.0) == 2 * 6
    assert plan_cost([[0, 1, 2]], [6, 4, 2], 1.0, 0.0) == 2 * 6  # 4 + 2 share the second row
    cfg = SimpleNamespace(
        hidden_size=128, num_attention_heads=4, head_dim=32, num_key_value_heads=2, intermediate_size=256
    )
    per_token, per_pair = layer_costs(cfg)
    assert per_token == 2 * (128 * 32 * (2 * 4 + 2 * 2) + 3 * 128 * 256)
    assert per_pair == 4 * 4 * 32
    assert layer_costs(SimpleNamespace()) == (1.0, 0.0)


class _OneProcess:
    """The accelerator surface policy_step.microbatches reads (one process, no DDP)."""

    num_processes, process_index = 1, 0

    @staticmethod
    def unwrap_model(model):
        return model


def _args(**kw):
    base = dict(pack_sequences=True, share_prompt_prefix=True, micro_batch_size=64, token_budget=100_000)
    return SimpleNamespace(**{**base, **kw})


def _batch(prompt_len, completion_len, group=8, seed=0):
    rng = random.Random(seed)
    samples = []
    for g in range(2):
        prompt = [rng.randrange(250) for _ in range(prompt_len)]
        samples += [_sample(prompt, [rng.randrange(250) for _ in range(completion_len)], g) for _ in range(group)]
    return SimpleNamespace(samples=samples)


def test_microbatches_choose_the_cheaper_layout(policy):
    from verifiers_rl.trainer.policy_step import microbatches

    acc, model = _OneProcess(), policy.base_model.model

    def layout(batch, **kw):
        mbs = microbatches(acc, model, batch, _args(**kw), 0)
        assert sum(mb.num_sequences for mb in mbs) == len(batch.samples)
        return "shared" if any(mb.num_shared_tokens for mb in mbs) else "plain"

    long_prompt = _batch(90, 30)  # the reverse-text shape: shared saves most of the work
    assert layout(long_prompt) == "shared"
    assert layout(long_prompt, share_prompt_prefix=False) == "plain"
    assert layout(long_prompt, pack_sequences=False) == "plain"
    assert layout(_batch(4, 400)) == "plain"  # long completions: one row of 8 x 400 costs more attention
    mbs = microbatches(acc, model, long_prompt, _args(micro_batch_size=8), 0)
    assert len(mbs) == 2 and all(mb.num_sequences == 8 for mb in mbs)  # the cap still holds
    model.config._attn_implementation = "flash_attention_2"  # no dense mask: plain packing (checked, not run)
    try:
        assert layout(long_prompt) == "plain"
    finally:
        model.config._attn_implementation = "sdpa"


def test_shared_gradients_equal_plain_under_activation_checkpointing():
    """A step through run_microbatches with checkpointed layers: the recompute inside backward attends under the
    same mask, so LoRA gradients match the plain layout's."""
    from accelerate import Accelerator

    from verifiers_rl.trainer.policy_step import run_microbatches

    model = lora_model(seed=4)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = _batch(40, 12, group=4, seed=5)
    batch.num_tokens = sum(sum(s.loss_mask) for s in batch.samples)
    batch.num_sequences = len(batch.samples)
    args = _args(temperature=1.0, kl_beta=0.0, loss_type="dapo", max_tokens=12, max_seq_len=64, epsilon=0.2,
                 epsilon_high=0.28, mask_ratio_low=0.125, mask_ratio_high=8.0)  # fmt: skip
    grads, layouts = [], []
    for share in (False, True):
        model.zero_grad()
        step_args = SimpleNamespace(**{**vars(args), "share_prompt_prefix": share})
        _, metrics = run_microbatches(Accelerator(cpu=True), model, batch, step_args, 0)
        layouts.append(metrics["shared_prefix_frac"])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert layouts[0] == 0 and layouts[1] > 0.5  # plain, then shared (the cost model's choice here)
    for n in grads[0]:
        scale = float(grads[0][n].abs().max()) + 1e-12
        assert float((grads[1][n] - grads[0][n]).abs().max()) / scale < 1e-4, n
    assert model.config._attn_implementation == "sdpa"
