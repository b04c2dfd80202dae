"""Online difficulty filtering in a real run (CPU engine, the rollout child, max_async_level 1): groups whose
rollouts all got the same reward are dropped and counted, a step trains batch_size rollouts when enough informative
groups were drawn, and a resumed run trains what the uninterrupted run trained."""

from __future__ import annotations

from pathlib import Path

import pytest
from rl_envs import WORDS, half_constant_env
from runs import tiny_rl_config

from verifiers_rl.export.reward_curve import read_metrics
from verifiers_rl.trainer import RLTrainer


def _train(tiny_model_dir, tmp_path: Path, name: str, resume: str | None = None) -> list[dict]:
    # 2 prompts per step, 6 drawn per batch: two batches are one pass over the 12 prompts, 6 of them constant
    args = tiny_rl_config(
        tmp_path, output_dir=str(tmp_path / name), batch_size=8, rollouts_per_example=4, max_async_level=1,
        max_steps=4, save_strategy="steps", save_steps=2, online_difficulty_filtering=True, oversampling_factor=3.0,
    )  # fmt: skip
    trainer = RLTrainer(model=tiny_model_dir, env=half_constant_env(), args=args)
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        trainer.close()
    return [r for r in read_metrics(Path(args.output_dir)) if "reward" in r]


def test_constant_reward_groups_are_dropped_steps_stay_full_and_a_resume_continues_exactly(tiny_model_dir, tmp_path):
    rows = _train(tiny_model_dir, tmp_path, "full")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert len(WORDS) == 2 * 6
    for one_pass in (rows[:2], rows[2:]):
        assert sum(r["filter_groups_dropped"] for r in one_pass) >= 6  # every constant prompt, maybe others too
    for r in rows:
        assert (r["filter_prompts_generated"], r["filter_prompts_extra"]) == (6, 4)
        kept = 2 - r["filter_groups_short"]
        assert r["filter_groups_dropped"] + r["filter_groups_unused"] + kept == 6
        assert r["rollouts"] == 4 * kept
        assert r["frac_reward_zero_std"] == 0  # nothing trained without a learning signal
    assert any(r["rollouts"] == 8 for r in rows)
    # from the step-2 checkpoint (batch 2 was generated ahead and saved in it): the same data position and groups
    resumed = _train(tiny_model_dir, tmp_path, "resumed", resume=str(tmp_path / "full" / "checkpoint-2"))
    assert [r["step"] for r in resumed] == [3, 4]
    for x, y in zip(rows[2:], resumed):
        assert {k: v for k, v in x.items() if k.startswith("filter_")} == {
            k: v for k, v in y.items() if k.startswith("filter_")
        }
        assert (x["reward"], x["rollouts"]) == (pytest.approx(y["reward"], abs=1e-9), y["rollouts"])
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5)
