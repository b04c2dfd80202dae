"""Rollouts -> training samples (pure functions): advantages per group, one sample per turn, shards per rank.

Every turn is one training sample: its prompt (earlier turns and environment responses included) is context,
its completion is trained, scored against the sampler's logprobs.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from verifiers_rl.batch.advantages import compute_advantages
from verifiers_rl.rollouts.env_tokens import environment_tokens, extends
from verifiers_rl.rollouts.metrics import rollout_metrics
from verifiers_rl.rollouts.prompts import template_kwargs
from verifiers_rl.rollouts.rollouts import Rollout, Turn, effective_rewards


@dataclass
class Sample:
    """One training sample: one assistant turn of a rollout, its prompt as context and its completion trained.

    The three per-token lists are aligned with `input_ids` (length T, the sample's tokens): entry t describes
    token t itself, not the token after it (microbatches.py does that shift when it collates).
    """

    input_ids: list[int]  # [T] prompt (earlier turns and environment responses included) + completion
    loss_mask: list[bool]  # [T] True where the token is trained; token 0 never is, whatever this says
    sampler_logprobs: list[float]  # [T] the engine's logprob of each token; 0.0 untrained, NaN where none exists
    advantage: float  # of its rollout, group-relative
    rollout: int  # index of its rollout in the step's batch
    group: int | None = None  # rollouts of a group share their prompt (prefix_sharing.py); None: shares nothing


@dataclass
class PreparedBatch:
    samples: list[Sample]
    num_tokens: int  # trained tokens in the whole step (all ranks): the loss normaliser
    num_sequences: int
    metrics: dict[str, float] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)  # why rollouts and samples were left out
    problem: str | None = None  # when no sample is left: the cause and the fix, in one line
    config_error: str | None = None  # every rollout failed with this one configuration error (diagnose.py)


def build_samples(
    rollouts: list[Rollout],
    advantages: list[float],
    valid: list[bool],
    *,
    max_seq_len: int,
    overlong_policy: str = "truncate",
    mask_env_responses: bool = True,
    mask_truncated_completions: bool = False,
    tokenizer=None,
    chat_template_kwargs: dict | None = None,
) -> tuple[list[Sample], Counter]:
    """One `Sample` per turn, and why rollouts and samples were left out.

    `sampler_logprobs` is NaN where no sampler logprob exists (environment tokens trained when
    mask_env_responses=False); the loss then treats those tokens as on-policy (ratio 1). Where a later turn's
    prompt re-renders the history (it does not extend the previous turn's prompt + completion), the environment's
    tokens are found by rendering its messages with `tokenizer`'s chat template and the run's
    `chat_template_kwargs` (env_tokens.py); a turn where that does not match the server's prompt trains none.
    """
    samples, counts = [], Counter()
    for idx, (r, adv, ok) in enumerate(zip(rollouts, advantages, valid)):
        if r.error is not None:
            counts[f"rollouts_{r.error_kind or 'errored'}"] += 1
            continue
        if not ok:
            counts["rollouts_nonfinite_reward"] += 1
            continue
        if mask_truncated_completions and r.is_truncated:
            counts["rollouts_masked_truncated"] += 1
            continue
        for k, turn in enumerate(r.turns):
            p, c = turn.prompt_ids, turn.completion_ids
            loss_mask = [False] * len(p) + [bool(m) for m in turn.completion_mask]
            logps = [0.0] * len(p) + [float(x) for x in turn.completion_logprobs]
            if k > 0:
                rerendered = not extends(p, r.turns[k - 1].prompt_ids + r.turns[k - 1].completion_ids)
                counts["turns_history_rerendered"] += rerendered
                if not mask_env_responses:
                    start = env_start(r, k, rerendered, tokenizer, chat_template_kwargs)
                    counts["turns_env_unmatched"] += start is None
                    for t in range(len(p) if start is None else start, len(p)):
                        loss_mask[t], logps[t] = True, math.nan
            ids = p + c
            if len(ids) > max_seq_len:
                if overlong_policy == "drop" or len(p) >= max_seq_len:
                    counts["samples_overlong_dropped"] += 1
                    continue
                ids, loss_mask, logps = ids[:max_seq_len], loss_mask[:max_seq_len], logps[:max_seq_len]
                counts["samples_overlong_truncated"] += 1
            if not any(loss_mask):
                counts["samples_without_trained_tokens"] += 1
                continue
            samples.append(Sample(ids, loss_mask, logps, advantage=float(adv), rollout=idx, group=r.group))
    counts["samples"] = len(samples)
    return samples, counts


def env_start(r: Rollout, k: int, rerendered: bool, tokenizer, chat_template_kwargs: dict | None) -> int | None:
    """Where the environment's tokens begin in turn k's prompt (they run to its end); None when not found."""
    turn, previous = r.turns[k], r.turns[k - 1]
    if not rerendered:  # the prompt extends what was sampled: what follows it is the environment's
        return len(previous.prompt_ids) + len(previous.completion_ids)
    if tokenizer is None or not r.messages or not _paired(turn, previous):
        return None
    n = environment_tokens(
        tokenizer,
        r.messages[: turn.message_index],
        previous.message_index,
        turn.prompt_ids,
        previous.completion_ids,
        chat_template_kwargs,
    )
    return None if n is None else len(turn.prompt_ids) - n


def _paired(turn: Turn, previous: Turn) -> bool:
    return (
        previous.message_index is not None
        and turn.message_index is not None
        and previous.message_index < turn.message_index
    )


def prepare_batch(rollouts: list[Rollout], args, current_version: int, tokenizer=None) -> PreparedBatch:
    """Advantages from rewards grouped by prompt, samples with masks, and the step's rollout metrics."""
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
        tokenizer=tokenizer,
        chat_template_kwargs=template_kwargs(args.sampling_args),
    )
    metrics = rollout_metrics(rollouts)
    metrics.update(
        {
            # over the rewards that enter the advantages (zero_truncated_completions applied)
            "reward": adv.stats["reward_mean"],
            "reward_std": adv.stats["reward_std"],
            "advantage_abs_mean": adv.stats["advantage_abs_mean"],
            "frac_reward_zero_std": adv.stats["frac_reward_zero_std"],
            "rollouts_nonfinite_reward": float(counts["rollouts_nonfinite_reward"]),
            "samples": float(len(samples)),
            "samples_overlong_truncated": float(counts["samples_overlong_truncated"]),
            "samples_overlong_dropped": float(counts["samples_overlong_dropped"]),
            # later turns whose prompt re-rendered the history (e.g. Qwen3 dropping earlier <think> blocks), and of
            # those trained with mask_env_responses=False, the ones whose environment tokens were not found
            "turns_history_rerendered": float(counts["turns_history_rerendered"]),
            "turns_env_unmatched": float(counts["turns_env_unmatched"]),
            "async_lag": float(current_version - min((r.policy_version for r in rollouts), default=current_version)),
        }
    )
    num_tokens = sum(sum(s.loss_mask) for s in samples)
    return PreparedBatch(samples, num_tokens, len(samples), metrics, counts)


def shard_samples(samples: list[Sample], world_size: int, rank: int) -> list[Sample]:
    """Split samples across ranks with balanced token counts (longest first onto the lightest rank).

    Deterministic, so every rank computes the same assignment from the same list."""
    if world_size == 1:
        return list(samples)
    loads = [0] * world_size
    owner = [0] * len(samples)
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].input_ids))
    for i in order:
        r = min(range(world_size), key=lambda k: (loads[k], k))
        owner[i] = r
        loads[r] += len(samples[i].input_ids)
    return [s for s, o in zip(samples, owner) if o == rank]
