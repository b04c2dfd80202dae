"""Online difficulty filtering with oversampling (prime-rl's `online_difficulty_filtering`, `oversampling_factor`).

A group whose rollouts all got the same reward has advantage 0 everywhere: it trains nothing, yet cost a full
generation. With the filter on, rollout batch b draws Q = ceil(P * oversampling_factor) prompts instead of P
(P = prompts_per_batch = batch_size / rollouts_per_example), generates all Q groups, drops the groups without
reward spread, and keeps the first P of the others in the order they were drawn. When fewer than P are left the
step trains what it has (fewer than batch_size rollouts, counted in `filter_groups_short`): oversampling_factor
bounds the extra generation at Q - P groups per batch; nothing loops until a batch is full.

Why everything is drawn up front rather than topped up in rounds: a batch stays a pure function of its index.
Batch b is prompts [b*Q, (b+1)*Q) of the seeded dataset stream whatever the rewards of earlier batches were, so
batches generated ahead (max_async_level > 0) wait for no earlier batch's results, every rollout's sampling seed
is fixed by (seed, batch, prompt, rollout), and the data position after a resume is the one an uninterrupted run
has. Rounds that top up a short batch would make where batch b+1 starts depend on batch b's rewards: a chain
through every batch, generated one after the other. The cost: Q groups are generated even when the first P
would all have been informative (`filter_groups_unused` counts those that were informative but not trained).

"No spread" is judged as the advantages judge it (advantages.py): the rewards that enter them
(zero_truncated_completions applied) agree within ZERO_STD_ATOL. prime-rl drops groups whose mean reward is 0.0 or
1.0, which is the same thing for binary rewards; this also drops a group of any other constant reward. A group
with a failed rollout (an error, or a reward that is not a finite number) is kept, so that its failure is
reported and diagnosed as it is without the filter.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from verifiers_rl.rollouts.rollouts import ZERO_STD_ATOL, Rollout, effective_rewards

logger = logging.getLogger(__name__)


def prompts_drawn(prompts_per_batch: int, oversampling_factor: float) -> int:
    """Prompts a batch draws: ceil(P * factor), rounded first so that 3 * 1.1 is 4, not float noise above it."""
    return max(prompts_per_batch, math.ceil(round(prompts_per_batch * oversampling_factor, 9)))


def uninformative(rollouts: Sequence[Rollout], rewards: Sequence[float]) -> bool:
    """Every rollout of the group finished and all their rewards agree: the group's advantages are all 0."""
    if any(r.error is not None for r in rollouts) or not all(math.isfinite(x) for x in rewards):
        return False
    return max(rewards) - min(rewards) <= ZERO_STD_ATOL


def select_groups(
    rollouts: list[Rollout], keep: int, zero_truncated: bool = False
) -> tuple[list[Rollout], dict[str, float]]:
    """The rollouts of the first `keep` groups (in the order they were drawn) that are not uninformative, and the
    counts as step metrics. A pure function of the rollouts: the same rewards select the same groups."""
    rewards = effective_rewards(rollouts, zero_truncated)
    members: dict[int, list[int]] = {}
    for i, r in enumerate(rollouts):
        members.setdefault(r.group, []).append(i)
    kept, dropped, unused = [], 0, 0
    for group in sorted(members):  # the group index is the prompt's position in the batch: dataset order
        idx = members[group]
        if uninformative([rollouts[i] for i in idx], [rewards[i] for i in idx]):
            dropped += 1
        elif len(kept) < keep:
            kept.append(group)
        else:
            unused += 1
    chosen = set(kept)
    metrics = {
        "filter_prompts_generated": float(len(members)),
        "filter_prompts_extra": float(max(len(members) - keep, 0)),
        "filter_groups_dropped": float(dropped),
        "filter_groups_unused": float(unused),
        "filter_groups_short": float(keep - len(kept)),
    }
    return [r for r in rollouts if r.group in chosen], metrics


@dataclass(frozen=True)
class DifficultyFilter:
    """The filter of one run: what a batch draws (`drawn`) and what of it trains (`select`)."""

    prompts_per_batch: int
    oversampling_factor: float = 1.0
    zero_truncated: bool = False

    @property
    def drawn(self) -> int:
        return prompts_drawn(self.prompts_per_batch, self.oversampling_factor)

    def select(self, rollouts: list[Rollout]) -> tuple[list[Rollout], dict[str, float]]:
        return select_groups(rollouts, self.prompts_per_batch, self.zero_truncated)

    @classmethod
    def of(cls, args) -> DifficultyFilter | None:
        """The filter an RLConfig asks for; None when online_difficulty_filtering is off."""
        if not args.online_difficulty_filtering:
            if args.oversampling_factor > 1:  # a hosted-training config's key, meaningless here without the filter
                logger.warning(
                    "oversampling_factor=%s has no effect without online_difficulty_filtering = true: each batch "
                    "draws batch_size / rollouts_per_example prompts",
                    args.oversampling_factor,
                )
            return None
        return cls(args.prompts_per_batch, args.oversampling_factor, args.zero_truncated_completions)
