"""verifiers 0.1.14 outputs -> Rollouts (pure functions).

A rollout is one episode of the environment: its reward, and one Turn per assistant response (prompt and
completion token ids, the sampler's logprobs). Token data comes from the server's responses, never from
re-tokenising text, so the trainer scores exactly what was sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

POLICY_VERSIONS_KEY = "vf_rl_policy_versions"  # state column our client fills, one entry per response
REWARD_ERRORS_KEY = "vf_rl_reward_errors"  # state column reward_checks fills when a reward function fails


@dataclass
class Turn:
    """One assistant turn: its prompt (everything before it, environment responses included) and completion."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[int]
    completion_logprobs: list[float]
    # where this turn's assistant message sits in its rollout's `messages`; None when the rollout's messages do not
    # line up with its turns (an environment that rewrites its own history)
    message_index: int | None = None


@dataclass
class Rollout:
    group: int  # index of the prompt within its batch: rollouts of one group share it
    reward: float
    turns: list[Turn]
    is_truncated: bool
    error: str | None
    policy_version: int
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_text: str = ""
    completion_text: str = ""
    # "rejected": the server refused a request (HTTP 400, e.g. a prompt longer than its context);
    # "errored": anything else failed (the environment, a reward function, the network)
    error_kind: str | None = None
    context: list | None = None  # prompt + completion messages of a rejected rollout, to say how long it was
    context_full: bool = False  # a later turn outgrew the server's context: the rollout ended there, truncated
    # prompt + completion as plain chat messages: where each turn's environment messages begin (samples.py)
    messages: list[dict] | None = None
    env: str | None = None  # the environment of a mixture it came from (env_mix.py); None with one environment


PROMPT_TOO_LONG = "the server rejected the prompt as longer than its context (max_model_len)"


def classify_error(out: dict) -> tuple[str | None, str | None]:
    """(kind, text) of a verifiers output's failure; (None, None) when it finished."""
    if out.get("prompt_too_long") and not context_full(out):  # verifiers' flag for the server's context-length 400
        return "rejected", PROMPT_TOO_LONG
    reward_errors = out.get(REWARD_ERRORS_KEY)
    if reward_errors:  # reward_checks.guard_rewards: the reward is not a score of this rollout
        return "errored", reward_errors[0]
    err = out.get("error")
    if err is None:
        if out.get("trajectory") and not any(t.get("tokens") for t in out["trajectory"]):
            return "errored", "server responses carried no token ids/logprobs (is return_token_ids supported?)"
        return None, None
    if isinstance(err, dict):
        # the repr chain carries the messages ("SandboxError('no key') -> ..."); the str chain only type names
        text = str(err.get("error_chain_repr") or err.get("error_chain_str") or err.get("error"))
    else:
        text = str(err)
    rejected = "BadRequestError" in text or "Error code: 400" in text
    return ("rejected" if rejected else "errored"), text


def context_full(out: dict) -> bool:
    """A later turn outgrew the server's context: verifiers ends the rollout there, truncated, with its earlier
    turns kept (each of those requests fitted). It trains like a rollout cut by max_tokens, not as a failure."""
    return bool(out.get("prompt_too_long")) and any(t.get("tokens") for t in out.get("trajectory") or [])


def _text(messages: Any) -> str:
    if isinstance(messages, str):
        return messages
    out = []
    for m in messages or []:
        role = m.get("role") if isinstance(m, dict) else getattr(m, "role", "")
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", "")
        out.append(f"{role}: {content}")
    return "\n".join(out)


def rollouts_from_outputs(outputs: list[dict], groups: list[int], policy_version: int) -> list[Rollout]:
    """verifiers `generate(...)["outputs"]` (same order as the inputs) -> Rollouts.

    The policy version of a rollout is the oldest version any of its turns was sampled with (the CPU engine
    reports it per response; with vLLM the version at submission is used)."""
    rollouts = []
    for out, group in zip(outputs, groups):
        turns = []
        messages = _messages(out)
        trajectory = out.get("trajectory") or []
        replies = assistant_positions(out, len(trajectory))
        for step, turn in enumerate(trajectory):
            tokens = turn.get("tokens")
            if tokens is None:
                continue
            turns.append(
                Turn(
                    list(tokens["prompt_ids"]),
                    list(tokens["completion_ids"]),
                    list(tokens["completion_mask"]),
                    list(tokens["completion_logprobs"]),
                    message_index=replies[step] if replies else None,
                )
            )
        versions = [int(v) for v in out.get(POLICY_VERSIONS_KEY) or [] if v is not None]
        kind, error = classify_error(out)
        reward = out.get("reward")
        rollouts.append(
            Rollout(
                group=group,
                reward=float("nan") if reward is None else float(reward),
                turns=turns,
                is_truncated=bool(out.get("is_truncated")) or context_full(out),
                error=error,
                policy_version=min(versions) if versions else policy_version,
                metrics={k: float(v) for k, v in (out.get("metrics") or {}).items() if _is_number(v)},
                prompt_text=_text(out.get("prompt")),
                completion_text=_text(out.get("completion")),
                error_kind=kind,
                context=messages if kind == "rejected" else None,
                context_full=context_full(out),
                messages=messages,
            )
        )
    return rollouts


def assistant_positions(out: dict, steps: int) -> list[int] | None:
    """Index in prompt + completion of each trajectory step's assistant message, or None when they do not pair up.

    A verifiers multi-turn rollout's completion is its turns' assistant messages with the environment's messages
    between them (MultiTurnEnv.render_completion), one assistant message per trajectory step."""
    prompt, completion = out.get("prompt"), out.get("completion")
    if not isinstance(completion, list):
        return None
    start = len(prompt) if isinstance(prompt, list) else 0
    found = [start + i for i, m in enumerate(completion) if _role(m) == "assistant"]
    return found if len(found) == steps else None


def _role(message) -> str | None:
    return message.get("role") if isinstance(message, dict) else getattr(message, "role", None)


def _messages(out: dict) -> list[dict]:
    """Prompt + completion as plain chat dicts (verifiers may hand back its pydantic message objects)."""
    prompt, completion = out.get("prompt"), out.get("completion")
    msgs = [*(prompt if isinstance(prompt, list) else []), *(completion if isinstance(completion, list) else [])]
    return [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in msgs]


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# Rewards closer than this are "equal": scorers often emit 0.1+0.2-style float noise for identical outcomes. A
# group whose rewards are all equal has zero advantage (batch.advantages) and is what difficulty filtering drops.
ZERO_STD_ATOL = 1e-8


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
