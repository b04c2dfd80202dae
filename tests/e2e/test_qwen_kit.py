"""The Qwen kit through the whole trainer: Qwen's BPE, 151,936 rows and a template that re-renders history, served
by our CPU engine. With enable_thinking=false every later prompt drops the previous turn's empty think block, so no
later turn extends the one before it; mask_env_responses=false must still find each environment turn."""

from __future__ import annotations

import json
from pathlib import Path

from rl_envs import again_env
from runs import tiny_rl_config

from verifiers_rl.trainer import RLTrainer


def test_multi_turn_non_thinking_trains_every_environment_turn(qwen_model_dir, tmp_path):
    args = tiny_rl_config(
        tmp_path,
        batch_size=8,
        rollouts_per_example=2,
        max_steps=1,
        max_async_level=0,
        max_tokens=4,
        max_seq_len=160,
        max_prompt_len=96,
        mask_env_responses=False,
        sampling_args={"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
    )
    trainer = RLTrainer(model=qwen_model_dir, env=again_env(), args=args)
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (Path(args.output_dir) / "metrics.jsonl").read_text().splitlines()]
    (m,) = [r for r in rows if "reward" in r]
    ok = m["rollouts"] - m["rollouts_errored"]
    assert ok == 8 and m["turns_mean"] == 2.0 and m["samples"] == 2 * ok
    assert m["turns_history_rerendered"] == ok  # the server rendered the think block, the history drops it
    assert m["turns_env_unmatched"] == 0
