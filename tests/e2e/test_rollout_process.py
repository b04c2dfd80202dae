"""Rollouts in a child process (`rollout_process`, the default): the environment's code really runs there, the
trainer names what it does, a copy that cannot be made or loaded falls back to the trainer's process, and a dead
child is a one-line error, never a hang or an orphan. The fault suites (test_faults, test_reliability) run through
the child as the default; the thread path keeps its own checks here."""

from __future__ import annotations

import os
import signal
import sys
import time
import types
from pathlib import Path

import pytest
import verifiers as vf
from datasets import Dataset
from rl_envs import MADE_AT_RUN_TIME, PIDS, WORDS, char_match, only_where_made, scorer_pid
from runs import steps
from runs import tiny_rl_config as _args

from verifiers_rl.rollouts.orchestrator import GenerationError
from verifiers_rl.rollouts.process import trim_outputs
from verifiers_rl.rollouts.rollouts import POLICY_VERSIONS_KEY, REWARD_ERRORS_KEY, rollouts_from_outputs
from verifiers_rl.rollouts.stages import Stages, stuck_message
from verifiers_rl.trainer import RLTrainer


def _env(extra_funcs=()) -> vf.SingleTurnEnv:
    rows = [{"question": f"Reverse: {w}", "answer": w[::-1]} for w in WORDS]
    funcs = [char_match, scorer_pid, *extra_funcs]
    rubric = vf.Rubric(funcs=funcs, weights=[1.0, 0.0, *([0.0] * len(extra_funcs))])
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows[:4]), rubric=rubric)


def _pids(path: Path) -> set[int]:
    return {int(x.split(":")[0]) for x in path.read_text().split()} if path.exists() else set()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_rollouts_are_scored_in_one_child_process_that_ends_with_training(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(PIDS, str(tmp_path / "pids"))
    args = _args(tmp_path, max_async_level=1, eval_strategy="steps", eval_steps=2)
    trainer = RLTrainer(model=tiny_model_dir, env=_env(), args=args)
    assert args.rollout_process  # the default
    trainer.train()
    pids = _pids(tmp_path / "pids")
    assert len(pids) == 1 and os.getpid() not in pids, pids  # training and evaluation rollouts: one child
    (child,) = pids
    assert _gone(child)  # train() closed it
    # the child imports verifiers and the environment's modules (here rl_envs, not this file), not torch
    assert set((tmp_path / "pids").read_text().split()) == {f"{child}:0"}
    assert steps(Path(args.output_dir)) == [1, 2]


def test_without_rollout_process_the_trainer_scores_its_rollouts(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(PIDS, str(tmp_path / "pids"))
    args = _args(tmp_path, rollout_process=False)
    RLTrainer(model=tiny_model_dir, env=_env(), args=args).train()
    assert _pids(tmp_path / "pids") == {os.getpid()}
    assert steps(Path(args.output_dir)) == [1, 2]


def _uncopyable_env():
    env = _env()
    env.cursor = (i for i in range(3))  # a generator: dill cannot copy it
    return env


def _unloadable_env():
    # a reward function whose module exists only in this process: it pickles by reference, the child cannot import it
    module = types.ModuleType("vf_rl_test_only_here")
    exec("def only_here(completion, **kw):\n    return 0.0\n", module.__dict__)
    sys.modules[module.__name__] = module
    return _env(extra_funcs=[module.only_here])


@pytest.mark.faults
@pytest.mark.parametrize(
    "make, why",
    [
        (_uncopyable_env, "the environment could not be copied into a rollout process (TypeError"),
        (_unloadable_env, "the environment did not load in the rollout process (ModuleNotFoundError"),
    ],
)
def test_an_environment_the_child_cannot_have_generates_in_the_trainer(tiny_model_dir, tmp_path, monkeypatch, caplog,
                                                                      make, why):  # fmt: skip
    monkeypatch.setenv(PIDS, str(tmp_path / "pids"))
    args = _args(tmp_path)
    with caplog.at_level("WARNING"):
        RLTrainer(model=tiny_model_dir, env=make(), args=args).train()
    warnings = [r.getMessage() for r in caplog.records if "rollouts run in the trainer's process" in r.getMessage()]
    assert len(warnings) == 1 and why in warnings[0], warnings
    assert _pids(tmp_path / "pids") == {os.getpid()}
    assert steps(Path(args.output_dir)) == [1, 2]


@pytest.mark.faults
def test_reward_functions_that_fail_only_in_the_child_are_scored_in_the_trainer(tiny_model_dir, tmp_path, monkeypatch,
                                                                               caplog):  # fmt: skip
    # the child loads the environment, then fails on its first call: checked once, on the first example, before the
    # first batch (not three failed steps that blame API keys)
    monkeypatch.setenv(PIDS, str(tmp_path / "pids"))
    module = types.ModuleType(MADE_AT_RUN_TIME)
    module.score = lambda completion: 0.5
    monkeypatch.setitem(sys.modules, MADE_AT_RUN_TIME, module)
    args = _args(tmp_path)
    with caplog.at_level("WARNING"):
        RLTrainer(model=tiny_model_dir, env=_env(extra_funcs=[only_where_made]), args=args).train()
    warnings = [r.getMessage() for r in caplog.records if "rollouts run in the trainer's process" in r.getMessage()]
    assert warnings == [
        "rollouts run in the trainer's process: the environment's code fails in the rollout process but not in the "
        "trainer's, on the first training example (reward function only_where_made raised ModuleNotFoundError: No "
        f"module named '{MADE_AT_RUN_TIME}')"
    ]
    scorers = (tmp_path / "pids").read_text().split()
    assert set(scorers[1:]) == {f"{os.getpid()}:1"}  # the check once more, and every rollout: here
    assert scorers[0] != scorers[1]  # the child scored only the check
    assert steps(Path(args.output_dir)) == [1, 2]


@pytest.mark.faults
def test_a_killed_rollout_process_is_one_error_naming_it(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(PIDS, str(tmp_path / "pids"))

    def slow_after_first_batch(completion, **kwargs) -> float:
        time.sleep(0.2)  # keeps a batch in flight long enough to be killed under it
        return 0.0

    args = _args(tmp_path, max_steps=50, max_async_level=1, generation_timeout=120)
    trainer = RLTrainer(model=tiny_model_dir, env=_env(extra_funcs=[slow_after_first_batch]), args=args)

    from transformers import TrainerCallback

    class KillChild(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                (child,) = _pids(tmp_path / "pids")
                os.kill(child, signal.SIGKILL)

    trainer.add_callback(KillChild())
    t0 = time.monotonic()
    with pytest.raises(GenerationError, match=r"the rollout process exited \(code -9, SIGKILL\): it was killed"):
        trainer.train()
    assert time.monotonic() - t0 < 100  # not generation_timeout
    assert trainer.runtime.orchestrator is None  # closed: nothing left running


# ---------------------------------------------------------------------------------------------- pure parts


def test_trimmed_outputs_make_the_same_rollouts():
    from pydantic import BaseModel

    class Message(BaseModel):  # what verifiers may hand back instead of dicts
        role: str
        content: str
        tool_calls: list | None = None

    tokens = {"prompt_ids": [1, 2], "completion_ids": [3, 4], "completion_mask": [1, 1]}
    tokens["completion_logprobs"] = [-0.1, -0.2]
    outputs = [
        {
            "reward": 0.5,
            "is_truncated": False,
            "metrics": {"char_match": 0.5, "label": "x"},
            "trajectory": [{"tokens": tokens, "response": object(), "prompt": [Message(role="user", content="hi")]}],
            POLICY_VERSIONS_KEY: [3],
            "prompt": [Message(role="user", content="hi")],
            "completion": [Message(role="assistant", content="ih")],
            "error": None,
            "answer": "ih",
        },
        {
            "reward": None,
            "trajectory": [],
            "prompt_too_long": True,
            "prompt": [{"role": "user", "content": "long"}],
            "completion": [],
            "error": {"error_chain_repr": "BadRequestError('Error code: 400')"},
        },
        {"reward": 0.0, "trajectory": [{"tokens": tokens}], REWARD_ERRORS_KEY: ["reward function f raised"]},
    ]
    trimmed, whole = (rollouts_from_outputs(o, [0, 0, 1], 2) for o in (trim_outputs(outputs), outputs))
    assert [repr(r) for r in trimmed] == [repr(r) for r in whole]  # repr: a rejected rollout's reward is nan
    assert "response" not in trim_outputs(outputs)[0]["trajectory"][0]


def test_mirrored_stages_read_as_the_child_sees_them():
    child, trainer = Stages(), Stages()
    with child.track("scoring", "reward function judge"), child.track("generation", "the inference server"):
        time.sleep(0.05)
        trainer.mirror(child.entries())
        time.sleep(0.05)
        acts = trainer.snapshot()
    names = [(a.stage, a.name) for a in acts]
    assert names == [("scoring", "reward function judge"), ("generation", "the inference server")]
    assert acts[0].oldest_s >= 0.1  # ages keep growing on the trainer's side: one clock for both processes
    assert trainer.overdue("scoring", 0.05) is not None and trainer.waiting_on_server() == 1
    assert stuck_message(trainer)[0] == "scoring"
    trainer.mirror([])
    assert trainer.snapshot() == []
