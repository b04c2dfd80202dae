"""Rollouts -> training samples. Pure functions over verifiers 0.1.14 outputs.

Every trajectory step (turn) is one training sample: its prompt (including earlier turns and environment
responses) is context, its completion is trained. Token data comes from the server's response (token ids and
the sampler's logprobs), never from re-tokenising text, so the trainer scores exactly what was sampled.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

POLICY_VERSIONS_KEY = "vf_rl_policy_versions"  # state column our client fills, one entry per response


@dataclass
class Step:
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[int]
    completion_logprobs: list[float]


@dataclass
class Rollout:
    example_id: Any
    group: int  # index of the prompt within its batch: rollouts of one group share it
    reward: float
    steps: list[Step]
    is_truncated: bool
    error: str | None
    policy_version: int
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_text: str = ""
    completion_text: str = ""


def _text(messages: Any) -> str:
    if isinstance(messages, str):
        return messages
    out = []
    for m in messages or []:
        role = m.get("role") if isinstance(m, dict) else getattr(m, "role", "")
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", "")
        out.append(f"{role}: {content}")
    return "\n".join(out)


def rollouts_from_outputs(outputs: list[dict], groups: list[int], submitted_version: int) -> list[Rollout]:
    """verifiers `generate(...)["outputs"]` (same order as the inputs) -> Rollouts.

    The policy version of a rollout is the oldest version any of its turns was sampled with (the CPU engine
    reports it per response; with vLLM the version at submission is used)."""
    rollouts = []
    for out, group in zip(outputs, groups):
        steps = []
        for turn in out.get("trajectory") or []:
            tokens = turn.get("tokens")
            if tokens is None:
                continue
            steps.append(
                Step(
                    list(tokens["prompt_ids"]),
                    list(tokens["completion_ids"]),
                    list(tokens["completion_mask"]),
                    list(tokens["completion_logprobs"]),
                )
            )
        versions = [int(v) for v in out.get(POLICY_VERSIONS_KEY) or [] if v is not None]
        error = out.get("error")
        if error is None and out.get("trajectory") and not steps:
            error = "server responses carried no token ids/logprobs (is return_token_ids supported?)"
        reward = out.get("reward")
        rollouts.append(
            Rollout(
                example_id=out.get("example_id"),
                group=group,
                reward=float("nan") if reward is None else float(reward),
                steps=steps,
                is_truncated=bool(out.get("is_truncated")),
                error=None if error is None else str(error),
                policy_version=min(versions) if versions else submitted_version,
                metrics={k: float(v) for k, v in (out.get("metrics") or {}).items() if _is_number(v)},
                prompt_text=_text(out.get("prompt")),
                completion_text=_text(out.get("completion")),
            )
        )
    return rollouts


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def effective_rewards(rollouts: list[Rollout], zero_truncated: bool) -> list[float]:
    """Rewards used for advantages: errored rollouts are NaN (dropped), truncated ones 0 when asked."""
    out = []
    for r in rollouts:
        if r.error is not None:
            out.append(float("nan"))
        elif zero_truncated and r.is_truncated:
            out.append(0.0)
        else:
            out.append(r.reward)
    return out


def build_samples(
    rollouts: list[Rollout],
    advantages: list[float],
    valid: list[bool],
    *,
    max_seq_len: int,
    overlong_policy: str = "truncate",
    mask_env_responses: bool = True,
    mask_truncated_completions: bool = False,
) -> tuple[list[dict], Counter]:
    """One sample per trajectory step: {input_ids, loss_mask, sampler_logprobs, advantage, rollout}.

    `sampler_logprobs` is NaN where no sampler logprob exists (environment tokens trained when
    mask_env_responses=False); the loss then treats those tokens as on-policy (ratio 1).
    """
    samples, counts = [], Counter()
    for idx, (r, adv, ok) in enumerate(zip(rollouts, advantages, valid)):
        if r.error is not None:
            counts["rollouts_errored"] += 1
            continue
        if not ok:
            counts["rollouts_nonfinite_reward"] += 1
            continue
        if mask_truncated_completions and r.is_truncated:
            counts["rollouts_masked_truncated"] += 1
            continue
        prev_end = 0
        for k, step in enumerate(r.steps):
            p, c = step.prompt_ids, step.completion_ids
            loss_mask = [False] * len(p) + [bool(m) for m in step.completion_mask]
            logps = [0.0] * len(p) + [float(x) for x in step.completion_logprobs]
            if not mask_env_responses and k > 0 and prev_end < len(p):
                # tokens the environment added since the previous turn's completion
                for t in range(prev_end, len(p)):
                    loss_mask[t], logps[t] = True, math.nan
            prev_end = len(p) + len(c)
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
            samples.append(
                {
                    "input_ids": ids,
                    "loss_mask": loss_mask,
                    "sampler_logprobs": logps,
                    "advantage": float(adv),
                    "rollout": idx,
                }
            )
    counts["samples"] = len(samples)
    return samples, counts
