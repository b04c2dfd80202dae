"""compute_advantages: hand-computed values for each scale, zero-std groups, non-finite rewards, errors."""

from __future__ import annotations

import math

import pytest
import torch

from verifiers_rl.batch.advantages import AdvantageResult, compute_advantages


def test_group_scale_hand_computed():
    # group a: [1, 0, 0, 1] mean 0.5 std 0.5; group b: [2, 4] mean 3 std 1
    res = compute_advantages([1.0, 0.0, 2.0, 0.0, 4.0, 1.0], ["a", "a", "b", "a", "b", "a"], eps=0.0)
    assert isinstance(res, AdvantageResult)
    assert res.advantages.dtype == torch.float32
    torch.testing.assert_close(res.advantages, torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, 1.0]))
    assert res.valid.all()


def test_eps_is_added_to_std():
    res = compute_advantages([1.0, 3.0], [0, 0], eps=1.0)  # std 1 -> divide by 2
    torch.testing.assert_close(res.advantages, torch.tensor([-0.5, 0.5]))


def test_batch_scale_uses_batch_std():
    rewards = [0.0, 2.0, 10.0, 14.0]
    res = compute_advantages(rewards, [0, 0, 1, 1], scale="batch", eps=0.0)
    batch_std = torch.tensor(rewards, dtype=torch.float64).std(correction=0).item()
    expected = torch.tensor([-1.0, 1.0, -2.0, 2.0]) / batch_std
    torch.testing.assert_close(res.advantages, expected)
    assert res.stats["reward_std"] == pytest.approx(batch_std)


def test_none_scale_only_centres():
    res = compute_advantages([0.0, 2.0, 10.0, 14.0], [0, 0, 1, 1], scale="none")
    torch.testing.assert_close(res.advantages, torch.tensor([-1.0, 1.0, -2.0, 2.0]))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_zero_std_groups_are_exactly_zero(scale):
    # group 0 identical up to float noise, group 1 a singleton, group 2 informative
    rewards = [0.1 + 0.2, 0.3, 0.3, 5.0, 0.0, 1.0]
    res = compute_advantages(rewards, [0, 0, 0, 1, 2, 2], scale=scale)
    assert (res.advantages[:4] == 0.0).all()
    assert (res.advantages[4:] != 0.0).all()
    assert res.stats["frac_reward_zero_std"] == pytest.approx(2 / 3)


def test_nonfinite_rewards_dropped_and_excluded_from_stats():
    rewards = [1.0, float("nan"), 0.0, float("inf"), 3.0, -float("inf")]
    groups = [0, 0, 0, 1, 1, 2]
    res = compute_advantages(rewards, groups, eps=0.0)
    assert res.valid.tolist() == [True, False, True, False, True, False]
    # group 0 valid [1, 0] -> +-1; group 1 single valid member -> 0; group 2 no valid member -> 0
    torch.testing.assert_close(res.advantages, torch.tensor([1.0, 0.0, -1.0, 0.0, 0.0, 0.0]))
    assert torch.isfinite(res.advantages).all()
    assert res.stats["num_nonfinite_rewards"] == 3
    assert res.stats["reward_mean"] == pytest.approx(4 / 3)
    assert res.stats["reward_std"] == pytest.approx(torch.tensor([1.0, 0.0, 3.0]).std(correction=0).item())
    # groups with >= 1 valid member: 0 (informative) and 1 (singleton) -> 1/2
    assert res.stats["frac_reward_zero_std"] == pytest.approx(0.5)
    assert res.stats["advantage_abs_mean"] == pytest.approx(2 / 3)


def test_all_invalid_and_empty():
    res = compute_advantages([float("nan")] * 2, ["x", "x"])
    assert res.advantages.tolist() == [0.0, 0.0] and not res.valid.any()
    assert all(math.isfinite(v) for v in res.stats.values())
    empty = compute_advantages([], [])
    assert empty.advantages.shape == (0,) and empty.stats["frac_reward_zero_std"] == 0.0


def test_group_ids_any_hashable_and_advantages_sum_to_zero_per_group():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(24, generator=gen).tolist()
    groups = [("prompt", i % 4) for i in range(24)]
    res = compute_advantages(rewards, groups)
    for g in range(4):
        assert res.advantages[g::4].sum().abs() < 1e-5
        assert res.advantages[g::4].std(correction=0) == pytest.approx(1.0, abs=1e-4)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"scale.*'group'.*'batch'.*'none'"):
        compute_advantages([1.0], [0], scale="rank")
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages([1.0, 2.0], [0])


def test_result_is_frozen():
    res = compute_advantages([1.0, 2.0], [0, 0])
    with pytest.raises(AttributeError):
        res.advantages = torch.zeros(2)
