"""policy_loss: hand-computed values and gradients per loss type, normalisation across micro-batches, KL, masks."""

from __future__ import annotations

import math

import pytest
import torch

from verifiers_rl.loss.losses import LOSS_TYPES, METRIC_REDUCTIONS, k3, policy_loss

# Two sequences, T=4. Row 0 trains tokens 1..3 (A=+1), row 1 trains tokens 0..1 (A=-2).
LP = [[-9.0, -1.0, -2.0, -0.5], [-0.3, -1.2, 5.0, 7.0]]
RATIOS = [[1.0, 1.5, 0.5, 1.0], [1.1, 10.0, 1.0, 1.0]]
MASK = [[False, True, True, True], [True, True, False, False]]
ADV = [1.0, -2.0]
N_TOK, N_SEQ = 5, 2


def _case():
    logp = torch.tensor(LP, requires_grad=True)
    sampler = torch.tensor(LP) - torch.tensor(RATIOS).log()
    return logp, sampler, torch.tensor(ADV), torch.tensor(MASK)


def _run(loss_type, **kw):
    logp, sampler, adv, mask = _case()
    kw = {"num_tokens_global": N_TOK, "num_sequences_global": N_SEQ, **kw}
    loss, metrics = policy_loss(logp, sampler, adv, mask, loss_type=loss_type, **kw)
    loss.backward()
    return loss.item(), logp.grad, metrics


def _grad(row0, row1):
    return torch.tensor([[0.0, *row0], [*row1, 0.0, 0.0]])


def test_is_hand_computed():
    loss, grad, m = _run("is")
    # -r*A per token, token with r=10 > 8 dropped: (-1.5 - 0.5 - 1.0 + 2.2) / 5
    assert loss == pytest.approx(-0.16)
    torch.testing.assert_close(grad, _grad([-1.5 / 5, -0.5 / 5, -1.0 / 5], [2.2 / 5, 0.0]))
    assert m["masked_frac"].item() == pytest.approx(1 / 5)
    assert m["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.0 + 1.1 + 10.0) / 5)
    assert m["ratio_min"].item() == pytest.approx(0.5) and m["ratio_max"].item() == pytest.approx(10.0)
    expected_kl = sum(r - math.log(r) - 1 for r in (1.5, 0.5, 1.0, 1.1, 10.0)) / 5
    assert m["mismatch_kl"].item() == pytest.approx(expected_kl, rel=1e-5)
    assert "kl" not in m


def test_grpo_hand_computed():
    loss, grad, m = _run("grpo")
    # PPO terms: row0 [-1.2 (clipped), -0.5, -1.0], row1 [2.2, 20.0]; weights 1/(3*2) and 1/(2*2)
    assert loss == pytest.approx(-2.7 / 6 + 22.2 / 4)
    torch.testing.assert_close(grad, _grad([0.0, -0.5 / 6, -1.0 / 6], [2.2 / 4, 20.0 / 4]))
    assert m["masked_frac"].item() == pytest.approx(1 / 5)


def test_dapo_hand_computed():
    loss, grad, m = _run("dapo", clip_eps_high=0.28)
    assert loss == pytest.approx((-1.28 - 0.5 - 1.0 + 2.2 + 20.0) / 5)
    torch.testing.assert_close(grad, _grad([0.0, -0.5 / 5, -1.0 / 5], [2.2 / 5, 20.0 / 5]))


def test_dr_grpo_hand_computed():
    loss, grad, _ = _run("dr_grpo", max_tokens=4)
    assert loss == pytest.approx(19.5 / (2 * 4))
    torch.testing.assert_close(grad, _grad([0.0, -0.5 / 8, -1.0 / 8], [2.2 / 8, 20.0 / 8]))
    with pytest.raises(ValueError, match="max_tokens"):
        _run("dr_grpo")


def test_gspo_hand_computed():
    eps = 3e-4
    loss, grad, m = _run("gspo", clip_eps_low=eps, clip_eps_high=eps)
    s0, s1 = 0.75 ** (1 / 3), math.sqrt(11.0)  # geometric-mean ratios; neither branch clips here
    assert loss == pytest.approx((-s0 * 1.0 + s1 * 2.0) / 2, rel=1e-6)
    # d loss / d l_t = -A_b * s_b / len_b / N_seq for each trained token of b
    torch.testing.assert_close(grad, _grad([-s0 / 3 / 2] * 3, [2.0 * s1 / 2 / 2] * 2))
    assert m["masked_frac"].item() == 0.0


def test_gspo_clipped_sequence_has_no_gradient():
    logp = torch.zeros(1, 3, requires_grad=True)
    sampler = torch.full((1, 3), -0.1)  # s = e^0.1 > 1 + eps with A > 0: clipped
    loss, m = policy_loss(
        logp,
        sampler,
        torch.tensor([1.0]),
        torch.ones(1, 3, dtype=torch.bool),
        loss_type="gspo",
        num_tokens_global=3,
        num_sequences_global=1,
        clip_eps_low=3e-4,
        clip_eps_high=4e-4,
    )
    loss.backward()
    assert loss.item() == pytest.approx(-(1 + 4e-4))
    assert (logp.grad == 0).all() and m["masked_frac"].item() == pytest.approx(1.0)


def test_cispo_hand_computed():
    loss, grad, m = _run("cispo")
    # -min(r, 1.2) * A * l: row0 [1.2, 1.0, 0.5], row1 [-0.66, -2.88]
    assert loss == pytest.approx((2.7 - 3.54) / 5)
    # gradient flows through l only, with the (detached, capped) IS weight: never zero, unlike PPO clipping
    torch.testing.assert_close(grad, _grad([-1.2 / 5, -0.5 / 5, -1.0 / 5], [2.2 / 5, 2.4 / 5]))
    assert m["masked_frac"].item() == pytest.approx(2 / 5)


@pytest.mark.parametrize("loss_type", ["is", "grpo", "dapo", "dr_grpo", "cispo"])
def test_on_policy_is_plain_policy_gradient(loss_type):
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 6, generator=gen) * 3).requires_grad_()
    mask = torch.rand(3, 6, generator=gen) > 0.3
    adv = torch.tensor([0.5, -1.0, 2.0])
    n_tok, n_seq = int(mask.sum()) + 7, 5  # as if other micro-batches held more
    loss, m = policy_loss(
        logp,
        logp.detach(),
        adv,
        mask,
        loss_type=loss_type,
        num_tokens_global=n_tok,
        num_sequences_global=n_seq,
        max_tokens=10,
    )
    loss.backward()
    if loss_type == "grpo":
        weight = 1.0 / (mask.sum(1, keepdim=True) * n_seq)
    elif loss_type == "dr_grpo":
        weight = torch.tensor(1.0 / (n_seq * 10))
    else:
        weight = torch.tensor(1.0 / n_tok)
    torch.testing.assert_close(logp.grad, -adv[:, None] * mask * weight)
    assert m["ratio_mean"].item() == pytest.approx(mask.sum().item() / n_tok)
    assert m["mismatch_kl"].item() == 0.0 and m["masked_frac"].item() == 0.0


def _random_batch(seed=0, b=4, t=7):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=gen) * 2
    sampler = logp + torch.randn(b, t, generator=gen) * 0.3
    ref = logp + torch.randn(b, t, generator=gen) * 0.2
    mask = torch.rand(b, t, generator=gen) > 0.3
    mask[:, 0] = True
    adv = torch.randn(b, generator=gen)
    return logp, sampler, ref, mask, adv


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("kl_beta", [0.0, 0.1])
def test_microbatch_split_sums_to_full_batch(loss_type, kl_beta):
    logp, sampler, ref, mask, adv = _random_batch()
    kw = dict(
        loss_type=loss_type,
        num_tokens_global=int(mask.sum()),
        num_sequences_global=4,
        max_tokens=7,
        clip_eps_high=0.28,
        kl_beta=kl_beta,
    )
    full_lp = logp.clone().requires_grad_()
    full, full_m = policy_loss(full_lp, sampler, adv, mask, ref_logprobs=ref, **kw)
    full.backward()
    split_lp = logp.clone().requires_grad_()
    total, metrics = 0.0, []
    for rows in (slice(0, 1), slice(1, 4)):
        part, m = policy_loss(split_lp[rows], sampler[rows], adv[rows], mask[rows], ref_logprobs=ref[rows], **kw)
        total = total + part
        metrics.append(m)
    total.backward()
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(split_lp.grad, full_lp.grad)
    for name, how in METRIC_REDUCTIONS.items():
        combined = getattr(torch.stack([m[name] for m in metrics]), how)()  # how in {sum, min, max}
        torch.testing.assert_close(combined, full_m[name])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_untrained_positions_never_contribute(loss_type):
    logp, sampler, ref, mask, adv = _random_batch(seed=1)
    kw = dict(
        loss_type=loss_type,
        num_tokens_global=int(mask.sum()),
        num_sequences_global=4,
        max_tokens=7,
        ref_logprobs=ref,
        kl_beta=0.1,
    )
    a = logp.clone().requires_grad_()
    loss_a, m_a = policy_loss(a, sampler, adv, mask, **kw)
    loss_a.backward()
    # garbage (inf, nan, huge) where the mask is False, as padding or prompt positions may hold
    garbage = torch.tensor([float("inf"), float("nan"), 1e6, -1e6]).repeat(logp.numel() // 4 + 1)[: logp.numel()]
    b = torch.where(mask, logp, garbage.view_as(logp)).requires_grad_()
    kw["ref_logprobs"] = torch.where(mask, ref, -50.0)
    loss_b, m_b = policy_loss(b, torch.where(mask, sampler, 50.0), adv, mask, **kw)
    loss_b.backward()
    torch.testing.assert_close(loss_b, loss_a)
    torch.testing.assert_close(b.grad, a.grad)
    assert (b.grad[~mask] == 0).all()
    for k in m_a:
        torch.testing.assert_close(m_b[k], m_a[k])


def test_is_ratio_bounds_mask_tokens():
    logp = torch.zeros(1, 4, requires_grad=True)
    sampler = -torch.tensor([[math.log(0.1), math.log(0.2), math.log(7.0), math.log(9.0)]])  # r = .1 .2 7 9
    loss, m = policy_loss(
        logp,
        sampler,
        torch.tensor([1.0]),
        torch.ones(1, 4, dtype=torch.bool),
        loss_type="is",
        num_tokens_global=4,
        num_sequences_global=1,
    )
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 3] == 0
    assert logp.grad[0, 1] < 0 and logp.grad[0, 2] < 0
    assert m["masked_frac"].item() == pytest.approx(0.5)


def test_clip_only_stops_gradient_on_the_profitable_side():
    # A > 0, r < 1 - eps and A < 0, r > 1 + eps: the min picks the unclipped term, gradient remains.
    logp = torch.zeros(2, 1, requires_grad=True)
    sampler = -torch.tensor([[math.log(0.5)], [math.log(2.0)]])
    loss, m = policy_loss(
        logp,
        sampler,
        torch.tensor([1.0, -1.0]),
        torch.ones(2, 1, dtype=torch.bool),
        loss_type="dapo",
        num_tokens_global=2,
        num_sequences_global=2,
    )
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.25], [1.0]]))
    assert m["masked_frac"].item() == 0.0


def test_kl_zero_when_ref_equals_logp_and_hand_gradient():
    logp, sampler, _, mask, adv = _random_batch(seed=2)
    kw = dict(loss_type="is", num_tokens_global=int(mask.sum()), num_sequences_global=4)
    base, _ = policy_loss(logp, sampler, adv, mask, **kw)
    with_kl, m = policy_loss(logp, sampler, adv, mask, ref_logprobs=logp.clone(), kl_beta=0.5, **kw)
    torch.testing.assert_close(with_kl, base)
    assert m["kl"].item() == 0.0
    # single token: d/dl [exp(ref-l) - (ref-l) - 1] = 1 - exp(ref-l)
    lp = torch.tensor([[-1.0]], requires_grad=True)
    loss, m = policy_loss(
        lp,
        lp.detach(),
        torch.tensor([0.0]),
        torch.ones(1, 1, dtype=torch.bool),
        loss_type="is",
        num_tokens_global=1,
        num_sequences_global=1,
        ref_logprobs=torch.tensor([[-2.0]]),
        kl_beta=2.0,
    )
    loss.backward()
    assert loss.item() == pytest.approx(2.0 * (math.exp(-1) + 1 - 1))
    assert lp.grad.item() == pytest.approx(2.0 * (1 - math.exp(-1)))
    assert m["kl"].item() == pytest.approx(math.exp(-1))


def test_k3_is_nonnegative_and_zero_at_zero():
    x = torch.linspace(-5, 5, 101)
    assert (k3(x) >= 0).all() and k3(torch.zeros(1)).item() == 0.0


def test_advantages_per_token_equal_per_row():
    logp, sampler, _, mask, adv = _random_batch(seed=3)
    kw = dict(num_tokens_global=int(mask.sum()), num_sequences_global=4)
    for loss_type in ("grpo", "gspo"):
        a, _ = policy_loss(logp, sampler, adv, mask, loss_type=loss_type, **kw)
        b, _ = policy_loss(logp, sampler, adv[:, None].expand_as(logp), mask, loss_type=loss_type, **kw)
        torch.testing.assert_close(a, b)


def test_empty_microbatch_and_errors():
    z = torch.zeros(1, 3)
    loss, m = policy_loss(
        z,
        z,
        torch.zeros(1),
        torch.zeros(1, 3, dtype=torch.bool),
        loss_type="grpo",
        num_tokens_global=0,
        num_sequences_global=0,
    )
    assert loss.item() == 0.0 and m["ratio_min"].item() == math.inf
    with pytest.raises(ValueError, match=r"loss_type.*'is'.*'cispo'"):
        policy_loss(z, z, torch.zeros(1), z.bool(), loss_type="ppo", num_tokens_global=1, num_sequences_global=1)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(
            z, z, torch.zeros(1), z.bool(), loss_type="is", num_tokens_global=1, num_sequences_global=1, kl_beta=0.1
        )
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(z, z, torch.zeros(2), z.bool(), loss_type="is", num_tokens_global=1, num_sequences_global=1)
