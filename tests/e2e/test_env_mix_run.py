"""Several environments in one run: `vf-rl` with two [[env]] tables (real CPU engine, real verifiers environments)
trains on both, mixed by their ratios, and reports each one's reward per step and at eval."""

from __future__ import annotations

import json
import math
import textwrap

from procs import run_command, survivors

TWO_ENVS = """
model = "{model}"
output_dir = "{out}"
[[env]]
id = "reverse-text"
ratio = 1
[env.args]
num_train_examples = 16
num_eval_examples = 4
[[env]]
id = "alphabet-sort"
ratio = 1
[env.args]
num_train_examples = 16
num_eval_examples = 4
max_turns = 1
[inference]
engine = "cpu"
[trainer.args]
max_steps = 2
rollouts_per_example = 2
batch_size = 8
micro_batch_size = 8
max_tokens = 8
max_seq_len = 512
save_strategy = "no"
log_completions = false
rollout_process = false  # in the trainer's process: the child's ~5 s a batch would double this test's time
[eval]
after = true
num_examples = 2
"""


def test_two_envs_train_and_report_reward_per_env(tmp_path, tiny_model_dir):
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(textwrap.dedent(TWO_ENVS.format(model=tiny_model_dir, out=tmp_path / "out")))
    r, pid = run_command("vf-rl", "@", cfg, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not survivors(pid)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "reward" in row and "step" in row]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:  # 4 prompts a step, ratio 1:1: two groups of 2 rollouts from each environment
        assert row["rollouts/reverse-text"] == 4 and row["rollouts/alphabet-sort"] == 4, row
        assert math.isfinite(row["reward/reverse-text"]) and math.isfinite(row["reward/alphabet-sort"])
    evals = {k: v for row in rows for k, v in row.items() if k.startswith("eval_after/r")}
    # eval runs on each environment: num_examples of each
    assert evals["eval_after/rollouts/reverse-text"] == 2 and evals["eval_after/rollouts/alphabet-sort"] == 2, evals
    assert (tmp_path / "out" / "reward_curve.png").exists()
