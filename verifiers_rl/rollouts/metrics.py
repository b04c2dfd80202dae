"""Rollout metrics (pure): one definition for training steps and evaluation, so their numbers compare."""

from __future__ import annotations

import math

from verifiers_rl.rollouts.rollouts import Rollout


def rollout_metrics(rollouts: list[Rollout], prefix: str = "") -> dict[str, float]:
    """Reward mean/std and the share scoring >= 1.0 over rollouts that finished with a finite reward, error and
    truncation counts, lengths,
    turns, the mean of every per-function reward (`rewards/<name>`) and, with several environments, the reward and
    rollouts of each (`reward/<env>`, `rollouts/<env>`). Keys get `prefix/` when given."""
    ok = [r for r in rollouts if r.error is None and math.isfinite(r.reward)]
    rewards = [r.reward for r in ok]
    mean = sum(rewards) / len(rewards) if rewards else float("nan")
    std = (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5 if rewards else float("nan")
    n = max(len(rollouts), 1)
    out = {
        "reward": mean,
        "reward_std": std,
        # a perfect score for rewards in [0, 1]: what a sampled mean hides (many half-right answers vs a few right)
        "perfect_frac": sum(x >= 1.0 for x in rewards) / len(rewards) if rewards else float("nan"),
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
    out.update(reward_by_env(rollouts))
    return {f"{prefix}/{k}" if prefix else k: v for k, v in out.items()}


def reward_by_env(rollouts: list[Rollout]) -> dict[str, float]:
    """`reward/<env>` (mean over its rollouts that finished; nan when none did) and `rollouts/<env>` for each
    environment of a mixture present in `rollouts`."""
    out = {}
    for name in sorted({r.env for r in rollouts if r.env is not None}):
        mine = [r for r in rollouts if r.env == name]
        ok = [r.reward for r in mine if r.error is None and math.isfinite(r.reward)]
        out[f"reward/{name}"] = sum(ok) / len(ok) if ok else float("nan")
        out[f"rollouts/{name}"] = float(len(mine))
    return out
