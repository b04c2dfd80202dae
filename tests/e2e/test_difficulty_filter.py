"""Online difficulty filtering in a real run (CPU engine, the rollout child, max_async_level 1): groups whose
rollouts all got the same reward are dropped and counted, and a step trains batch_size rollouts when enough
informative groups were drawn."""

from __future__ import annotations

from pathlib import Path

from rl_envs import WORDS, half_constant_env
from runs import tiny_rl_config

from verifiers_rl.rl.trainer import RLTrainer
from verifiers_rl.rl.trainer.callbacks import read_metrics


def test_constant_reward_groups_are_dropped_and_steps_stay_full(tiny_model_dir, tmp_path):
    # 2 prompts per step, 6 drawn per batch: the two batches are one pass over the 12 prompts, 6 of them constant
    args = tiny_rl_config(
        tmp_path, batch_size=8, rollouts_per_example=4, max_async_level=1,
        online_difficulty_filtering=True, oversampling_factor=3.0,
    )  # fmt: skip
    trainer = RLTrainer(model=tiny_model_dir, env=half_constant_env(), args=args)
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = [r for r in read_metrics(Path(args.output_dir)) if "reward" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert len(WORDS) == 2 * 6
    assert sum(r["filter_groups_dropped"] for r in rows) >= 6  # every constant prompt, maybe a few others
    for r in rows:
        assert (r["filter_prompts_generated"], r["filter_prompts_extra"]) == (6, 4)
        kept = 2 - r["filter_groups_short"]
        assert r["filter_groups_dropped"] + r["filter_groups_unused"] + kept == 6
        assert r["rollouts"] == 4 * kept
        assert r["frac_reward_zero_std"] == 0  # nothing trained without a learning signal
    assert any(r["rollouts"] == args.batch_size for r in rows)
