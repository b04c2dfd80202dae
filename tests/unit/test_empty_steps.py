"""The rules that decide when a run that trains nothing stops (diagnose.py), and the context rule (limits.py)."""

from collections import Counter

import pytest

from verifiers_rl.batch.samples import PreparedBatch
from verifiers_rl.config.limits import request_fits, room_for_prompt
from verifiers_rl.errors import TrainingError
from verifiers_rl.rollouts.rollouts import Rollout
from verifiers_rl.trainer.diagnose import EmptySteps, configuration_error, explain_empty_step, summarize


def _rollout(error=None, kind=None):
    return Rollout(group=0, reward=0.0, turns=[], is_truncated=False, error=error, policy_version=0, error_kind=kind)


def _prepared(n: int, problem: str | None = None, errored: int = 0) -> PreparedBatch:
    return PreparedBatch([], 0, n, problem=problem, counts=Counter(rollouts_errored=errored))


def test_one_configuration_error_in_every_rollout_is_recognised():
    key = "SandboxCreationError(APIError('No API key configured. Set PRIME_API_KEY environment variable.'))"
    assert configuration_error([_rollout(key, "errored")] * 4) == key
    module = "reward function judge raised ModuleNotFoundError: No module named 'sympy'"
    assert configuration_error([_rollout(module, "errored")] * 4) == module
    # a flaky judge, two different errors, or a rollout that worked: later steps may do better
    assert configuration_error([_rollout("ValueError: judge unreachable", "errored")] * 4) is None
    assert configuration_error([_rollout(key, "errored"), _rollout(module, "errored")]) is None
    assert configuration_error([_rollout(key, "errored"), _rollout()]) is None
    assert configuration_error([]) is None


def test_every_rollout_failing_on_a_bug_of_its_own_code_is_not_blamed_on_keys():
    def cause(error: str) -> str:
        return explain_empty_step([_rollout(error, "errored")] * 8, Counter(rollouts_errored=8), args=None)

    bug = cause("reward function has_vowel raised NameError: name 're' is not defined")
    assert "a NameError is a bug in the environment's own code" in bug and "API keys" not in bug
    assert "UnboundLocalError is a bug" in cause("UnboundLocalError(\"cannot access local variable 'x'\")")
    for requirement in ("SandboxCreationError(APIError('No API key configured.'))", "ValueError: judge unreachable"):
        assert "check the environment's requirements (API keys" in cause(requirement)


def test_a_configuration_error_stops_at_its_step_and_empty_steps_after_the_limit():
    ledger = EmptySteps(limit=3)
    assert ledger.record(1, _prepared(0, "cause A")) == "step 1 has nothing to train (1 of 3): cause A"
    assert ledger.record(2, _prepared(5)) is None  # a step that trained resets the count
    with pytest.raises(TrainingError, match=r"^step 3: every one of the 8 rollouts failed with the same configuration"):
        ledger.record(3, _prepared(0, "cause B", errored=8), config_error="No module named 'x'")
    ledger = EmptySteps(limit=2)
    ledger.record(1, _prepared(0, "cause A"))
    with pytest.raises(TrainingError, match="^2 consecutive steps had nothing to train: cause A$"):
        ledger.record(2, _prepared(0, "cause A"))


def test_a_run_that_trained_nothing_fails_at_its_end_naming_each_steps_cause():
    ledger = EmptySteps(limit=10)
    for step, cause in [(1, "A"), (2, "A"), (3, "B")]:
        ledger.record(step, _prepared(0, cause))
    with pytest.raises(TrainingError, match=r"none of its 3 steps had a trainable sample \(steps 1-2: A; step 3: B\)"):
        ledger.check_trained()
    ledger.record(4, _prepared(1))
    ledger.check_trained()  # one trained step is enough
    EmptySteps(limit=1).check_trained()  # a resume with nothing left to do trained nothing, and that is fine


def test_summarize_joins_runs_of_consecutive_steps_only():
    assert summarize([(1, "A"), (2, "A"), (4, "A"), (5, "B")]) == "steps 1-2: A; step 4: A; step 5: B"


def test_the_context_rule_is_vllms():
    assert room_for_prompt(256, 48) == 208 and room_for_prompt(256, None) == 255
    assert request_fits(208, 48, 256) and not request_fits(209, 48, 256)
    assert request_fits(255, None, 256) and not request_fits(256, None, 256) and not request_fits(0, 8, 256)
