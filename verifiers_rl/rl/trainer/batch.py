"""A rollout batch -> this rank's training samples and the step's rollout metrics (pure functions)."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from verifiers_rl.rl.trainer.advantages import compute_advantages
from verifiers_rl.rl.trainer.rollouts import Rollout, build_samples, effective_rewards


@dataclass
class PreparedBatch:
    samples: list[dict]
    num_tokens: int  # trained tokens in the whole step (all ranks): the loss normaliser
    num_sequences: int
    metrics: dict[str, float] = field(default_factory=dict)


def prepare_batch(rollouts: list[Rollout], args, current_version: int) -> PreparedBatch:
    """Advantages from rewards grouped by prompt, samples with masks, and the rollout-side metrics."""
    rewards = effective_rewards(rollouts, args.zero_truncated_completions)
    adv = compute_advantages(rewards, [r.group for r in rollouts], scale=args.scale_rewards)
    samples, counts = build_samples(
        rollouts,
        adv.advantages.tolist(),
        adv.valid.tolist(),
        max_seq_len=args.max_seq_len,
        overlong_policy=args.overlong_policy,
        mask_env_responses=args.mask_env_responses,
        mask_truncated_completions=args.mask_truncated_completions,
    )
    num_tokens = sum(sum(s["loss_mask"]) for s in samples)
    n = max(len(rollouts), 1)
    ok = [r for r in rollouts if r.error is None]
    completion_tokens = [sum(len(s.completion_ids) for s in r.steps) for r in ok]
    metrics = {
        "reward": adv.stats["reward_mean"],
        "reward_std": adv.stats["reward_std"],
        "advantage_abs_mean": adv.stats["advantage_abs_mean"],
        "frac_reward_zero_std": adv.stats["frac_reward_zero_std"],
        "rollouts": float(len(rollouts)),
        "rollouts_errored": float(counts["rollouts_errored"]),
        "rollouts_nonfinite_reward": float(counts["rollouts_nonfinite_reward"]),
        "truncated_frac": sum(r.is_truncated for r in rollouts) / n,
        "samples": float(len(samples)),
        "samples_overlong_truncated": float(counts["samples_overlong_truncated"]),
        "samples_overlong_dropped": float(counts["samples_overlong_dropped"]),
        "completion_tokens_mean": sum(completion_tokens) / max(len(completion_tokens), 1),
        "turns_mean": sum(len(r.steps) for r in ok) / max(len(ok), 1),
        "async_lag": float(current_version - min((r.policy_version for r in rollouts), default=current_version)),
    }
    per_metric: dict[str, list[float]] = defaultdict(list)
    for r in ok:
        for k, v in r.metrics.items():
            if math.isfinite(v):
                per_metric[k].append(v)
    for k, vs in per_metric.items():
        metrics[f"rewards/{k}"] = sum(vs) / len(vs)
    return PreparedBatch(samples, num_tokens, len(samples), metrics)


def shard_samples(samples: list[dict], world_size: int, rank: int) -> list[dict]:
    """Split samples across ranks with balanced token counts (longest first onto the lightest rank).

    Deterministic, so every rank computes the same assignment from the same list."""
    if world_size == 1:
        return list(samples)
    loads = [0] * world_size
    owner = [0] * len(samples)
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]["input_ids"]))
    for i in order:
        r = min(range(world_size), key=lambda k: (loads[k], k))
        owner[i] = r
        loads[r] += len(samples[i]["input_ids"])
    return [s for s, o in zip(samples, owner) if o == rank]
