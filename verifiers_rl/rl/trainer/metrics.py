"""Rollout metrics (pure): one definition for training steps and evaluation, so their numbers compare."""

from __future__ import annotations

import math

from verifiers_rl.rl.trainer.rollouts import Rollout


def rollout_metrics(rollouts: list[Rollout], prefix: str = "") -> dict[str, float]:
    """Reward mean/std over rollouts that finished with a finite reward, error and truncation counts, lengths,
    turns, and the mean of every per-function reward (`rewards/<name>`). Keys get `prefix/` when given."""
    ok = [r for r in rollouts if r.error is None and math.isfinite(r.reward)]
    rewards = [r.reward for r in ok]
    mean = sum(rewards) / len(rewards) if rewards else float("nan")
    std = (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5 if rewards else float("nan")
    n = max(len(rollouts), 1)
    out = {
        "reward": mean,
        "reward_std": std,
        "rollouts": float(len(rollouts)),
        "rollouts_rejected": float(sum(r.error_kind == "rejected" for r in rollouts)),
        "rollouts_errored": float(sum(r.error_kind == "errored" for r in rollouts)),
        "truncated_frac": sum(r.is_truncated for r in rollouts) / n,
        "rollouts_context_full": float(sum(r.context_full for r in rollouts)),
        "completion_tokens_mean": sum(sum(len(t.completion_ids) for t in r.turns) for r in ok) / max(len(ok), 1),
        "turns_mean": sum(len(r.turns) for r in ok) / max(len(ok), 1),
    }
    for key in sorted({k for r in ok for k in r.metrics}):
        vals = [r.metrics[key] for r in ok if key in r.metrics and math.isfinite(r.metrics[key])]
        if vals:
            out[f"rewards/{key}"] = sum(vals) / len(vals)
    return {f"{prefix}/{k}" if prefix else k: v for k, v in out.items()}
