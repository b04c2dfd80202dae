"""Which policy version samples each rollout batch, and which batches are submitted ahead, with num_iterations."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from rl_envs import reverse_env

from verifiers_rl.rollouts.orchestrator import Orchestrator
from verifiers_rl.trainer.runtime import InferenceRuntime


def _orchestrator(k: int, per: int) -> Orchestrator:
    env = reverse_env()
    return Orchestrator(
        env, env.get_dataset(), base_url="http://127.0.0.1:1/v1", model_name="m", sampling_args={},
        rollouts_per_example=2, prompts_per_batch=1, max_async_level=k, steps_per_batch=per,
    )  # fmt: skip


@pytest.mark.parametrize(
    "k, per, versions",
    [
        (0, 1, [0, 1, 2, 3]),  # on-policy: batch b after the sync of step b
        (1, 1, [0, 0, 1, 2]),
        (0, 2, [0, 2, 4, 6]),  # batch b is first trained at step 2b, sampled after that step's sync
        (1, 2, [0, 1, 3, 5]),  # ... or one step earlier
        (3, 2, [0, 0, 1, 3]),
    ],
)
def test_a_batch_is_sampled_by_the_version_k_steps_before_its_first_step(k, per, versions):
    assert [_orchestrator(k, per).required_version(b) for b in range(4)] == versions


class _Recorder:
    def __init__(self):
        self.submitted: list[int] = []

    def submit(self, index: int) -> None:
        self.submitted.append(index)


@pytest.mark.parametrize(
    "k, per, step, batches",
    [
        (1, 1, 5, [5, 6]),
        (0, 2, 3, [1]),  # step 3 trains batch 1 again: nothing new to sample
        (1, 2, 3, [1, 2]),  # batch 2 (first trained at step 4) may start once step 3's weights are synced
        (1, 2, 2, [1]),
        (2, 2, 2, [1, 2]),
    ],
)
def test_submit_ahead_submits_the_batches_first_trained_within_k_steps(k, per, step, batches):
    runtime = InferenceRuntime.__new__(InferenceRuntime)  # only its schedule: no server
    runtime.args = SimpleNamespace(max_async_level=k, num_iterations=per)
    runtime.orchestrator = _Recorder()
    runtime.submit_ahead(step)
    assert runtime.orchestrator.submitted == batches
