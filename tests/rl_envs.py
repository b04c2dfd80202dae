"""Small verifiers environments for trainer tests (classic 0.1.14 API, data generated in code)."""

from __future__ import annotations

import importlib
import os
import sys

import verifiers as vf
from datasets import Dataset

WORDS = ["cat", "dog", "sun", "map", "pen", "cup", "hat", "box", "owl", "ink", "jam", "kit"]


def _text(completion) -> str:
    if isinstance(completion, list):
        return "".join(str(m.get("content") or "") for m in completion if m.get("role") == "assistant")
    return str(completion)


def char_match(completion, answer, **kwargs) -> float:
    """Fraction of answer characters matched position by position: dense enough for a random tiny model."""
    text = _text(completion)
    return sum(a == b for a, b in zip(text, answer)) / len(answer)


def variety(completion, **kwargs) -> float:
    """Distinct characters written (up to 8): varies across rollouts whatever the sampler's random stream, so a
    group always has non-zero advantages (char_match alone is all-zero for most seeds of a random model)."""
    return min(len(set(_text(completion))), 8) / 8


PIDS = "VF_RL_TEST_SCORER_PIDS"


def scorer_pid(completion, **kwargs) -> float:
    """A metric (weight 0) that writes down which process scored the rollout, and whether it has torch loaded."""
    with open(os.environ[PIDS], "a") as f:
        f.write(f"{os.getpid()}:{int('torch' in sys.modules)}\n")
    return 0.0


MADE_AT_RUN_TIME = "vf_rl_test_made_at_run_time"


def only_where_made(completion, **kwargs) -> float:
    """Scores only in a process that made the module MADE_AT_RUN_TIME at run time (a test's trainer process):
    code that works in the trainer's process and fails in the rollout process."""
    return importlib.import_module(MADE_AT_RUN_TIME).score(completion)


def length_bonus(completion, **kwargs) -> float:
    return min(len(_text(completion)), 8) / 8


def reverse_env(n: int = 12) -> vf.SingleTurnEnv:
    rows = [{"question": f"Reverse: {w}", "answer": w[::-1]} for w in WORDS[:n]]
    ds = Dataset.from_list(rows)
    rubric = vf.Rubric(funcs=[char_match, length_bonus], weights=[1.0, 0.1])
    return vf.SingleTurnEnv(dataset=ds, eval_dataset=Dataset.from_list(rows[:4]), rubric=rubric)


def solved_or_variety(completion, answer, **kwargs) -> float:
    """1.0 for every rollout of a prompt whose answer starts with '=' (a group with nothing to learn), else variety."""
    return 1.0 if answer.startswith("=") else variety(completion)


def half_constant_env() -> vf.SingleTurnEnv:
    """Every other prompt's reward is constant: the groups online difficulty filtering drops."""
    rows = [{"question": f"Say {w}", "answer": ("=" if i % 2 == 0 else "") + w} for i, w in enumerate(WORDS)]
    ds = Dataset.from_list(rows)
    return vf.SingleTurnEnv(dataset=ds, eval_dataset=ds.select(range(4)), rubric=vf.Rubric(funcs=[solved_or_variety]))


class AgainEnv(vf.MultiTurnEnv):
    """Two assistant turns: the environment answers the first with 'again'."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "again"}]


def again_env() -> AgainEnv:
    ds = Dataset.from_list([{"question": f"Say {w}", "answer": w} for w in WORDS[:6]])
    return AgainEnv(dataset=ds, rubric=vf.Rubric(funcs=[char_match, variety], weights=[1.0, 0.1]), max_turns=2)


class _SandboxWithoutKey(vf.MultiTurnEnv):
    """What a sandbox environment does without its API key: every rollout fails after the first turn."""

    async def env_response(self, messages, state, **kwargs):
        raise vf.SandboxError("PRIME_API_KEY is not set: cannot create a sandbox")


def sandbox_env_without_key() -> vf.MultiTurnEnv:
    ds = Dataset.from_list([{"question": f"Run {w}", "answer": w} for w in WORDS[:6]])
    return _SandboxWithoutKey(dataset=ds, rubric=vf.Rubric(funcs=[char_match]), max_turns=3)


def python_env_without_key() -> vf.MultiTurnEnv:
    """Upstream's math-python in small: verifiers' own PythonEnv (a prime sandbox per rollout) on a local dataset.
    Without PRIME_API_KEY every rollout fails to create its sandbox, with the same error."""
    ds = Dataset.from_list([{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(6)])
    return vf.PythonEnv(dataset=ds, rubric=vf.Rubric(funcs=[char_match]), max_turns=3)
