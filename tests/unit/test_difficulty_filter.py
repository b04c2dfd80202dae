"""Online difficulty filtering: which groups a batch trains (pure functions), which prompts it draws, and that
neither depends on timing nor on where a run resumed."""

from __future__ import annotations

import asyncio
import io
import random
import zlib

import pytest
import torch
from rl_envs import reverse_env

from verifiers_rl.rollouts.client import ROLLOUT_KEY
from verifiers_rl.rollouts.difficulty_filter import DifficultyFilter, prompts_drawn, select_groups
from verifiers_rl.rollouts.orchestrator import Orchestrator, batch_rows
from verifiers_rl.rollouts.rollouts import Rollout
from verifiers_rl.sync.policy_sync import PolicyVersion


def _group(group: int, rewards, error: str | None = None, truncated: bool = False) -> list[Rollout]:
    return [
        Rollout(
            group=group, reward=r, turns=[], is_truncated=truncated, error=error if k == 0 else None, policy_version=0
        )  # fmt: skip
        for k, r in enumerate(rewards)
    ]


def _groups(rollouts: list[Rollout]) -> list[int]:
    return sorted({r.group for r in rollouts})


@pytest.mark.parametrize("p, factor, drawn", [(8, 1.0, 8), (3, 1.1, 4), (4, 2.5, 10), (10, 1.1, 11), (2, 1.01, 3)])
def test_a_batch_draws_ceil_of_prompts_times_factor(p, factor, drawn):
    assert prompts_drawn(p, factor) == drawn


def test_groups_without_reward_spread_are_dropped_and_the_first_informative_ones_kept():
    rollouts = [
        *_group(0, [1.0, 1.0, 1.0]),  # all solved
        *_group(1, [0.0, 1.0, 0.0]),
        *_group(2, [0.3, 0.3 + 1e-12, 0.3]),  # float noise only: no spread (as advantages.py judges it)
        *_group(3, [0.5, 0.2, 0.5]),
        *_group(4, [0.0, 0.0, 0.0]),  # all failed
        *_group(5, [0.1, 0.9, 0.5]),  # informative, beyond the two the batch needs
    ]
    kept, m = select_groups(rollouts, keep=2)
    assert _groups(kept) == [1, 3]
    assert len(kept) == 6  # whole groups
    assert m == {
        "filter_prompts_generated": 6.0,
        "filter_prompts_extra": 4.0,
        "filter_groups_dropped": 3.0,
        "filter_groups_unused": 1.0,
        "filter_groups_short": 0.0,
    }


def test_too_few_informative_groups_train_what_is_left_and_say_how_many_are_missing():
    kept, m = select_groups([*_group(0, [1, 1]), *_group(1, [0, 1]), *_group(2, [0, 0])], keep=2)
    assert _groups(kept) == [1]
    assert (m["filter_groups_dropped"], m["filter_groups_short"], m["filter_prompts_extra"]) == (2.0, 1.0, 1.0)


def test_a_group_with_a_failed_rollout_is_kept_so_its_failure_is_reported():
    errored = _group(0, [1.0, 1.0], error="SandboxError('no key')")
    nan = _group(1, [float("nan"), float("nan")])
    kept, m = select_groups([*errored, *nan, *_group(2, [1.0, 1.0])], keep=3)
    assert _groups(kept) == [0, 1]
    assert m["filter_groups_dropped"] == 1.0


def test_spread_is_judged_on_the_rewards_the_advantages_use():
    truncated = _group(0, [1.0, 1.0], truncated=True)  # zero_truncated_completions: rewards 0, 0
    mixed = [*_group(1, [1.0]), *_group(1, [1.0], truncated=True)]  # zero_truncated: 1 and 0
    assert _groups(select_groups([*truncated, *mixed], keep=2)[0]) == []
    assert _groups(select_groups([*truncated, *mixed], keep=2, zero_truncated=True)[0]) == [1]


# ---------------------------------------------------------------- the orchestrator: what a batch is made of

EASY = {"Reverse: cat", "Reverse: sun", "Reverse: pen", "Reverse: hat", "Reverse: owl", "Reverse: kit"}


def _orchestrator(delays: random.Random | None = None, factor: float = 2.0) -> Orchestrator:
    """Prompts per batch 2, group size 3, 12 rows. Generation is faked: a reward that is constant for EASY prompts
    and follows the rollout's seed key otherwise, each request finishing after a random delay (`delays`)."""
    env = reverse_env()
    orch = Orchestrator(
        env, env.get_dataset(), base_url="http://127.0.0.1:1/v1", model_name="m", sampling_args={},
        rollouts_per_example=3, prompts_per_batch=2, max_async_level=100, seed=5, policy_version=PolicyVersion(0),
        difficulty_filter=DifficultyFilter(2, factor),
    )  # fmt: skip

    async def fake_run(inputs, sampling_args):
        if delays is not None:
            await asyncio.sleep(delays.random() * 0.05)
        outputs = []
        for row in inputs:
            # EASY prompts: the same reward for every rollout; the others: one that follows the rollout's seed key
            reward = 1.0 if row["question"] in EASY else (zlib.crc32(row[ROLLOUT_KEY].encode()) % 7) / 7
            outputs.append({"reward": reward, "trajectory": [], "prompt": row["question"], "completion": ""})
        return {"outputs": outputs}

    orch._run = fake_run
    return orch


def _made_of(orch: Orchestrator, indices) -> list[tuple]:
    batches = [orch.get(i) for i in indices]
    return [(b.index, [(r.group, r.prompt_text, r.reward) for r in b.rollouts], b.filter_metrics) for b in batches]


def test_a_batch_draws_its_own_slice_of_the_stream_whatever_came_before():
    orch = _orchestrator(factor=1.5)  # 2 prompts needed, 3 drawn
    stream = batch_rows(0, 3 * 8, 12, 5, True)  # prompts 0..23 of the seeded stream (two epochs)
    questions = orch.dataset["question"]
    for b in (5, 0, 3):  # any order: a batch is a pure function of its index
        inputs, groups = orch.inputs_for(b)
        assert [inputs[3 * j]["question"] for j in range(3)] == [questions[i] for i in stream[3 * b : 3 * b + 3]]
        assert groups == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_same_seed_same_selection_whatever_order_batches_finish_in_and_after_a_resume():
    runs = []
    for seed in (0, 1):  # different arrival orders of the batches generated ahead
        orch = _orchestrator(random.Random(seed))
        try:
            for b in range(4):
                orch.submit(b)  # all four in flight at once (max_async_level > 0)
            runs.append(_made_of(orch, range(4)))
        finally:
            orch.close()
    assert runs[0] == runs[1]
    dropped = sum(m["filter_groups_dropped"] for _, _, m in runs[0])
    assert dropped > 0 and all(len(rs) == 6 for _, rs, m in runs[0] if not m["filter_groups_short"])
    assert not any(p in EASY for _, rs, _ in runs[0] for _, p, _ in rs)  # constant-reward groups never train
    # a run resumed at batch 2 (a fresh orchestrator: the data position is the batch index) trains what the
    # uninterrupted run trained; a ready batch saved in a checkpoint keeps its selection and counts
    resumed = _orchestrator(random.Random(2))
    try:
        assert _made_of(resumed, [2, 3]) == runs[0][2:]
        resumed.submit(1)
        state = resumed.state_dict()
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        again = _orchestrator()
        again.load_state_dict(torch.load(buf, weights_only=False))
        assert _made_of(again, [1]) == runs[0][1:2]
        again.close()
    finally:
        resumed.close()


def test_the_filter_of_a_config_and_a_factor_without_the_filter_is_named(caplog):
    from types import SimpleNamespace

    on = SimpleNamespace(online_difficulty_filtering=True, oversampling_factor=1.5, prompts_per_batch=4,
                         zero_truncated_completions=True)  # fmt: skip
    assert DifficultyFilter.of(on) == DifficultyFilter(4, 1.5, True) and DifficultyFilter.of(on).drawn == 6
    with caplog.at_level("WARNING"):
        assert DifficultyFilter.of(SimpleNamespace(**{**vars(on), "online_difficulty_filtering": False})) is None
    assert "oversampling_factor=1.5 has no effect" in caplog.text
