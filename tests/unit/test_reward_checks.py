"""Broken environments, checked on real verifiers environments without a run (tests/e2e/test_faults.py runs the
whole vf-rl path for the kinds whose way out differs: a raise, a missing column, no examples, a broken turn)."""

from __future__ import annotations

import asyncio
import math

import pytest
import verifiers as vf
from datasets import Dataset

from verifiers_rl.errors import TrainingError
from verifiers_rl.rollouts.reward_checks import _rubrics, check_dataset, check_reward_inputs, guard_rewards
from verifiers_rl.rollouts.rollouts import REWARD_ERRORS_KEY


def _env(func, rows=None) -> vf.SingleTurnEnv:
    rows = rows if rows is not None else [{"question": f"say {i}", "answer": str(i)} for i in range(4)]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[func]))


def _reward(env):
    """The user's reward function as the environment holds it (verifiers may group rubrics)."""
    return next(r.funcs[0] for r in _rubrics(env.rubric) if getattr(r, "funcs", None))


def _score(env, state: dict):
    return asyncio.run(_reward(env)(completion="x", answer="1", state=state))


@pytest.mark.parametrize(
    "value, shown", [(None, "None"), ("0.5", "'0.5'"), (math.nan, "nan"), (math.inf, "inf"), (True, "True")]
)
def test_a_reward_that_is_not_a_finite_number_errors_the_rollout_by_name(value, shown):
    def returns_it(completion, **kw):
        return value

    env = _env(returns_it)
    guard_rewards(env)
    state: dict = {}
    assert _score(env, state) == 0.0
    assert state[REWARD_ERRORS_KEY] == [f"reward function returns_it returned {shown}, not a finite number"]


def test_a_good_reward_passes_through_untouched_and_guarding_twice_wraps_once():
    def good(completion, answer, **kw):
        return 0.25

    env = _env(good)
    guard_rewards(env)
    guarded = _reward(env)
    assert guarded is not good
    guard_rewards(env)
    assert _reward(env) is guarded
    state: dict = {}
    assert _score(env, state) == 0.25 and REWARD_ERRORS_KEY not in state


def test_a_dataset_without_prompts_is_refused_naming_its_columns():
    env = _env(lambda completion, **kw: 1.0)
    with pytest.raises(TrainingError, match=r"has no 'prompt' column \(columns: text\)"):
        check_dataset(env, Dataset.from_list([{"text": "x"}] * 4))
    check_dataset(env, env.get_dataset())  # verifiers built 'prompt' from 'question'


def test_a_reward_reading_a_column_the_dataset_lacks_is_refused_before_the_run():
    def reads_answer(completion, answer):
        return 1.0

    env = _env(reads_answer, rows=[{"question": f"say {i}"} for i in range(4)])
    with pytest.raises(TrainingError, match="reads `answer`, but the training dataset has no 'answer' column"):
        check_reward_inputs(env, env.get_dataset())


def test_a_timed_out_reward_function_leads_the_message_even_when_requests_started_earlier():
    """The race CI hit once: a reward function past scoring_timeout while other rollouts' requests, sent a moment
    earlier, were still answered. The function that timed out is named first; the requests are listed after it;
    the server is cleared in so many words only when no request waits on it."""
    import time

    from verifiers_rl.rollouts.stages import Stages, stuck_message

    stages = Stages()
    with stages.track("generation", "the inference server"), stages.track("generation", "the inference server"):
        time.sleep(0.02)
        with stages.track("scoring", "reward function never_returns"):
            time.sleep(0.02)
            late = stages.overdue("scoring", 0.01)
            assert late is not None
            assert stuck_message(stages)[0] == "generation"  # the longest-running leads by default
            stage, where = stuck_message(stages, culprit=late)
            assert stage == "scoring", where
            assert where.startswith("stuck in scoring: reward function never_returns running for"), where
            assert "; also 2 request(s) to the inference server waiting" in where
            assert "no request is waiting" not in where
    with stages.track("scoring", "reward function never_returns"):
        time.sleep(0.02)
        _, where = stuck_message(stages, culprit=stages.overdue("scoring", 0.01))
        assert where.endswith("no request is waiting on the inference server: the environment is stuck, not the server")
