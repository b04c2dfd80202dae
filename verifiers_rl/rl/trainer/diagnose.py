"""Why a step had nothing to train, in one line that names the cause and the fix.

A run whose every request is rejected, whose every rollout errors, or whose every sample is cut away must not
finish "successfully" with loss 0: the trainer logs the cause per step and, after `max_empty_steps`
consecutive empty steps, stops with the line built here.
"""

from __future__ import annotations

from verifiers_rl.rl.trainer.prompts import prompt_length, tools_for
from verifiers_rl.rl.trainer.rollouts import Rollout


def first_error(rollouts: list[Rollout], kind: str) -> str | None:
    return next((r.error for r in rollouts if r.error_kind == kind), None)


def _longest_context(rollouts: list[Rollout], tokenizer, env) -> int | None:
    lengths = []
    for r in rollouts:
        if r.error_kind == "rejected" and r.context:
            try:
                lengths.append(prompt_length(tokenizer, r.context, tools_for(env)))
            except Exception:  # noqa: BLE001 - a diagnosis must never mask the cause it reports
                continue
    return max(lengths) if lengths else None


def explain_empty_step(
    rollouts: list[Rollout], counts, args, tokenizer=None, env=None, context_limit: int | None = None
) -> str:
    """What left this step without a trainable sample, and what to change. `context_limit`: the server's
    max_model_len as it reports it (it can be shorter than the config plans for)."""
    n = len(rollouts)
    rejected, errored = counts.get("rollouts_rejected", 0), counts.get("rollouts_errored", 0)
    if n and rejected == n:
        longest = _longest_context(rollouts, tokenizer, env) if tokenizer is not None else None
        limit = context_limit or args.server_max_len
        if longest is not None and longest + (args.max_tokens or 1) > limit:
            fix = "raise max_seq_len"
            if limit < args.server_max_len:
                fix = f"start the server with --max-model-len >= {longest + (args.max_tokens or 1)}"
            return (
                f"all {n} requests were rejected by the server: the prompt plus tools is {longest:,} tokens and "
                f"max_tokens={args.max_tokens} must fit too, but the server's context is {limit:,} tokens: {fix}"
            )
        return f"all {n} requests were rejected by the server (first: {first_error(rollouts, 'rejected')})"
    if n and rejected + errored == n:
        cause = first_error(rollouts, "errored") or first_error(rollouts, "rejected")
        return (
            f"every rollout failed ({errored} errored, {rejected} rejected; first: {cause}); check the environment's "
            "requirements (API keys of judges or sandboxes, installed extras) with `vf-eval`"
        )
    masked = counts.get("rollouts_masked_truncated", 0)
    if masked and masked + rejected + errored == n:
        return (
            f"every rollout hit max_tokens={args.max_tokens} and mask_truncated_completions=True drops them: "
            "raise max_tokens or set mask_truncated_completions=False"
        )
    if counts.get("samples_overlong_dropped", 0):
        return (
            f"every sample is longer than max_seq_len={args.max_seq_len} and overlong_policy='drop' removes them: "
            "raise max_seq_len or use overlong_policy='truncate'"
        )
    if counts.get("rollouts_nonfinite_reward", 0):
        return "every reward was NaN or infinite: check the environment's reward functions"
    return f"no rollout produced a trained token ({dict(counts)})"
