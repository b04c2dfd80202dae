"""A user's own training script and notebook (tests/scripts/own_rewards.py and .ipynb) define their reward
functions, helpers, a closure over a lookup table, a class-based parser and an environment method at module level.
With the rollout process (the default) they run in the child, and each rollout scores there exactly as the trainer's
own process scores it (`rollout_process=False`); before this, every rollout failed with a NameError."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from runs import steps

from verifiers_rl.export.reward_curve import read_metrics

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
ANSWERS = {w[::-1] for w in ["cat", "dog", "sun", "map", "pen", "cup", "hat", "box"]}
FELL_BACK = "rollouts run in the trainer's process"


def _scored(out: Path) -> tuple[set[int], list[str]]:
    """The processes that scored, and each scoring (completion and the three reward functions' values) as text."""
    rows = [json.loads(x) for x in (out / "scored.jsonl").read_text().splitlines()]
    return {r.pop("pid") for r in rows}, [json.dumps(r, sort_keys=True) for r in rows]


def _trainer_pid(stdout: str) -> int:
    return int(re.search(r"trainer pid (\d+)", stdout).group(1))


def _rewards(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["reward"]) for r in read_metrics(out) if "reward" in r]


def _check_same_scores(with_process: Path, without: Path, trainer_pid: int) -> None:
    children, there = _scored(with_process)
    assert len(children) == 1 and trainer_pid not in children  # one child scored every rollout, the trainer none
    scorers, here = _scored(without)
    assert scorers == {trainer_pid}
    # the child's first scoring is the check before the first batch: the first example, answered with its answer
    check = json.loads(there.pop(0))
    assert check["text"] in ANSWERS and check["first_word_match"] == 1.0 and check["has_vowel"] == 1.0
    assert len(here) == 2 * 16  # 2 steps of 16 rollouts
    assert sorted(there) == sorted(here)  # the same rollouts, scored the same in both processes
    scorings = [json.loads(r) for r in here]
    assert any(r["has_vowel"] for r in scorings) and any(r["letter_value"] for r in scorings)
    assert {r["answer_vowels"] for r in scorings} == {1}  # setup_state ran: each answer has one vowel
    assert _rewards(with_process) == _rewards(without) and steps(with_process) == [1, 2]


def test_a_scripts_own_reward_functions_score_in_the_rollout_process_as_in_the_trainers(tiny_model_dir, tmp_path):
    script = [sys.executable, str(SCRIPTS / "own_rewards.py"), tiny_model_dir, str(tmp_path), "true", "false"]
    r = subprocess.run(script, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert FELL_BACK not in r.stderr, r.stderr[-3000:]
    _check_same_scores(tmp_path / "true", tmp_path / "false", _trainer_pid(r.stdout))


def test_a_notebooks_own_reward_functions_score_in_the_rollout_process_as_in_the_trainers(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("OWN_REWARDS_MODEL_DIR", tiny_model_dir)
    monkeypatch.setenv("OWN_REWARDS_OUTPUT_DIR", str(tmp_path))
    nb = nbformat.read(SCRIPTS / "own_rewards.ipynb", as_version=4)
    NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert FELL_BACK not in text, text[-3000:]
    _check_same_scores(tmp_path / "true", tmp_path / "false", _trainer_pid(text))
