"""Why a step had nothing to train, in one line that names the cause and the fix.

A run whose every request is rejected, whose every rollout errors, or whose every sample is cut away must not
finish "successfully" with loss 0: the trainer logs the cause per step and stops with the line built here after
`max_empty_steps` consecutive empty steps, at once when every rollout of a step failed with one configuration
error (a missing API key or module), and at the end of a run that trained nothing, whatever its length.
"""

from __future__ import annotations

import logging
import re

from verifiers_rl.errors import TrainingError
from verifiers_rl.rollouts.prompts import prompt_length, template_kwargs, tools_for
from verifiers_rl.rollouts.rollouts import Rollout

logger = logging.getLogger(__name__)


def report_failures(rollouts, prepared, step: int, seen: set, args, tokenizer, env, context_limit) -> None:
    """Rank 0: say once per distinct cause that rollouts were rejected or errored; explain an empty step (its
    cause, and the configuration error every rollout failed with, if one did)."""
    for kind in ("rejected", "errored"):
        n = int(prepared.counts.get(f"rollouts_{kind}", 0))
        text = first_error(rollouts, kind)
        if n and text not in seen:
            seen.add(text)
            logger.warning("step %d: %d of %d rollouts %s (first: %s)", step, n, len(rollouts), kind, text)
    if prepared.num_sequences == 0:
        prepared.problem = explain_empty_step(rollouts, prepared.counts, args, tokenizer, env, context_limit)
        prepared.config_error = configuration_error(rollouts)


def first_error(rollouts: list[Rollout], kind: str) -> str | None:
    return next((r.error for r in rollouts if r.error_kind == kind), None)


def _longest_context(rollouts: list[Rollout], tokenizer, env, chat_template_kwargs: dict) -> int | None:
    lengths = []
    for r in rollouts:
        if r.error_kind == "rejected" and r.context:
            try:
                lengths.append(prompt_length(tokenizer, r.context, tools_for(env), chat_template_kwargs))
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
        kwargs = template_kwargs(args.sampling_args)
        longest = _longest_context(rollouts, tokenizer, env, kwargs) if tokenizer is not None else None
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
        bug = code_error(cause)
        if bug is not None:
            return (
                f"every rollout failed ({errored} errored, {rejected} rejected; first: {cause}); a {bug} "
                "is a bug in the environment's own code (a reward function, parser or environment method), not a "
                "missing key or extra: call that code on one completion in your own process"
            )
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


# exceptions no API key or installed extra fixes: the code itself is wrong (a missing module stays a requirement)
_CODE_ERRORS = re.compile(r"\b(NameError|UnboundLocalError|AttributeError|TypeError|SyntaxError)\b")


def code_error(cause: str | None) -> str | None:
    """The exception type in an error text when it is a fault of the code that raised it."""
    found = _CODE_ERRORS.search(cause or "")
    return found.group(1) if found else None


# what a configuration error says, whoever raised it: a missing key or credential, a missing module or extra
_CONFIGURATION = (
    "api key",
    "api_key",
    "apikey",
    "no module named",
    "modulenotfounderror",
    "importerror",
    "authenticationerror",
    "permissiondeniederror",
    "unauthorized",
    "error code: 401",
    "error code: 403",
    "credentials",
    "environment variable",
    "is not installed",
)


def configuration_error(rollouts: list[Rollout]) -> str | None:
    """The error every rollout of a step failed with, when it is one and the same configuration error (a missing
    API key, module or credential): no later step can do better, so the run stops at this one."""
    texts = {r.error for r in rollouts if r.error_kind == "errored"}
    if not rollouts or len(texts) != 1 or any(r.error_kind != "errored" for r in rollouts):
        return None
    text = next(iter(texts)) or ""
    return text if any(marker in text.lower() for marker in _CONFIGURATION) else None


class EmptySteps:
    """The steps of one `train()` that had nothing to train, and why. Every rank keeps the same ledger (the
    prepared batch is broadcast), so every rank raises the same error at the same step."""

    def __init__(self, limit: int):
        self.limit = limit
        self.consecutive = 0
        self.steps_run = 0
        self.trained_samples = 0
        self.causes: list[tuple[int, str]] = []  # (step, cause) of each empty step

    def record(self, step: int, prepared, config_error: str | None = None) -> str | None:
        """Count one step; raise when the run must stop now. Returns the warning to log for an empty step."""
        self.steps_run += 1
        self.trained_samples += prepared.num_sequences
        if prepared.num_sequences:
            self.consecutive = 0
            return None
        self.consecutive += 1
        cause = prepared.problem or "no trainable sample"
        self.causes.append((step, cause))
        if config_error is not None:
            n = prepared.counts.get("rollouts_errored", 0)
            raise TrainingError(
                f"step {step}: every one of the {n} rollouts failed with the same configuration error, so no later "
                f"step can train: {config_error}; fix what it names (an API key, a module, credentials) and check "
                "the environment with `vf-eval`"
            )
        if self.consecutive >= self.limit:
            raise TrainingError(f"{self.consecutive} consecutive steps had nothing to train: {cause}")
        return f"step {step} has nothing to train ({self.consecutive} of {self.limit}): {cause}"

    def check_trained(self) -> None:
        """At the end of `train()`: a run whose steps trained no sample at all is a failure, whatever its length."""
        if self.steps_run and not self.trained_samples:
            raise TrainingError(
                f"the run trained nothing: none of its {self.steps_run} steps had a trainable sample "
                f"({summarize(self.causes)})"
            )


def summarize(causes: list[tuple[int, str]]) -> str:
    """`step 1: X; steps 2-4: Y`: runs of consecutive steps with the same cause, once each."""
    runs: list[list] = []
    for step, cause in causes:
        if runs and runs[-1][2] == cause and runs[-1][1] == step - 1:
            runs[-1][1] = step
        else:
            runs.append([step, step, cause])
    return "; ".join(f"step {a}: {c}" if a == b else f"steps {a}-{b}: {c}" for a, b, c in runs)
