"""Group-relative advantages (GRPO family) from per-rollout rewards.

For rollout i in group g with reward r_i, over the *valid* (finite-reward) members V_g of g:

    mu_g    = mean_{j in V_g} r_j
    sigma_g = sqrt(mean_{j in V_g} (r_j - mu_g)^2)          (population std, correction 0)
    A_i     = (r_i - mu_g) / d

with d = sigma_g + eps for scale="group", d = sigma_B + eps for scale="batch" (sigma_B the population std of
all valid rewards in the batch), and d = 1 for scale="none". A group whose valid rewards all agree (within
1e-8), or that has a single valid member, carries no learning signal: its advantages are exactly 0 in every
mode. Rollouts with a NaN/inf reward are invalid: advantage 0, valid False, excluded from every statistic.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from verifiers_rl.rollouts.rollouts import ZERO_STD_ATOL

SCALES = ("group", "batch", "none")


@dataclass(frozen=True)
class AdvantageResult:
    """advantages: float32 [N]; valid: bool [N]; stats: scalar metrics for logging."""

    advantages: torch.Tensor
    valid: torch.Tensor
    stats: dict[str, float]


def _group_index(group_ids: Sequence[Hashable]) -> tuple[torch.Tensor, int]:
    """Map arbitrary hashable group ids to 0..G-1 in order of first appearance."""
    mapping: dict[Hashable, int] = {}
    index = [mapping.setdefault(g, len(mapping)) for g in group_ids]
    return torch.tensor(index, dtype=torch.long), len(mapping)


def _segment_sum(values: torch.Tensor, index: torch.Tensor, num: int) -> torch.Tensor:
    return torch.zeros(num, dtype=values.dtype).index_add_(0, index, values)


def compute_advantages(
    rewards: Sequence[float],
    group_ids: Sequence[Hashable],
    scale: str = "group",
    eps: float = 1e-6,
) -> AdvantageResult:
    """Centre rewards by their group's valid mean and optionally scale them (see module docstring).

    stats: reward_mean / reward_std / reward_min / reward_max over valid rewards (0.0 when none is valid),
    frac_reward_zero_std over groups with >= 1 valid member, num_nonfinite_rewards, num_groups,
    advantage_abs_mean over valid rollouts.
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if len(rewards) != len(group_ids):
        raise ValueError(
            f"rewards and group_ids must have the same length, got len(rewards)={len(rewards)} "
            f"and len(group_ids)={len(group_ids)}"
        )
    # float64 keeps the 1e-8 equality test meaningful for rewards of any magnitude we expect.
    r = torch.tensor([float(x) for x in rewards], dtype=torch.float64)
    gidx, num_groups = _group_index(group_ids)
    valid = torch.isfinite(r)
    vf = valid.to(torch.float64)
    r0 = torch.where(valid, r, torch.zeros_like(r))  # NaN * 0 is NaN, so zero invalid rewards explicitly

    count = _segment_sum(vf, gidx, num_groups)
    mean = _segment_sum(r0, gidx, num_groups) / count.clamp(min=1)
    centred = torch.where(valid, r0 - mean[gidx], torch.zeros_like(r0))
    var = _segment_sum(centred**2, gidx, num_groups) / count.clamp(min=1)
    std = var.sqrt()
    hi = torch.full((num_groups,), -math.inf, dtype=torch.float64).scatter_reduce(0, gidx[valid], r0[valid], "amax")
    lo = torch.full((num_groups,), math.inf, dtype=torch.float64).scatter_reduce(0, gidx[valid], r0[valid], "amin")
    has_valid = count > 0
    zero_std = has_valid & ((count == 1) | (hi - lo <= ZERO_STD_ATOL))

    rv = r0[valid]
    n_valid = int(rv.numel())
    batch_std = rv.std(correction=0) if n_valid else torch.tensor(0.0, dtype=torch.float64)
    if scale == "group":
        adv = centred / (std[gidx] + eps)
    elif scale == "batch":
        adv = centred / (batch_std + eps)
    else:
        adv = centred
    adv = torch.where(valid & ~zero_std[gidx], adv, torch.zeros_like(adv)).to(torch.float32)

    n_groups_valid = int(has_valid.sum())
    stats = {
        "reward_mean": float(rv.mean()) if n_valid else 0.0,
        "reward_std": float(batch_std),
        "reward_min": float(rv.min()) if n_valid else 0.0,
        "reward_max": float(rv.max()) if n_valid else 0.0,
        "frac_reward_zero_std": float(zero_std.sum()) / n_groups_valid if n_groups_valid else 0.0,
        "num_nonfinite_rewards": float(len(rewards) - n_valid),
        "num_groups": float(num_groups),
        "advantage_abs_mean": float(adv[valid].abs().mean()) if n_valid else 0.0,
    }
    return AdvantageResult(advantages=adv, valid=valid, stats=stats)
