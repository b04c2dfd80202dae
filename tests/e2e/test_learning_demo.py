"""The offline learning demos: `vf-rl @ configs/vf-rl/tiny-reverse-text.toml` and `tiny-alphabet-sort.toml` (an SFT
warm-start on a systematically wrong teacher's transcripts, then RL against the environment's reward).

The full runs (slow-marked, 2.5 and 9 min on an idle 2-core machine, SFT included) check issue 56's goals at half
their size, so that noise between runs does not fail them but losing what RL teaches does: RL's own share of the
held-out reward (after RL minus after the warm-start) greedy >= +0.075 (goal +0.15) in both demos, and sampled at
temperature 1.0 >= +0.125 (goal +0.25) in the multi-turn one; the summary reports every number and the curve
carries held-out points. The fast tests check that the tiny configs plan what the demos need and that the
multi-turn tiny config runs end to end.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import tomllib
from pathlib import Path

import pytest
from procs import ROOT, run_command, survivors

DEMO = ROOT / "configs" / "vf-rl" / "tiny-reverse-text.toml"
DEMO_SFT = ROOT / "configs" / "vf-sft" / "tiny-reverse-text.toml"
DEMO_FULL = ROOT / "configs" / "vf-rl" / "tiny-reverse-text-full.toml"
ALPHABET = ROOT / "configs" / "vf-rl" / "tiny-alphabet-sort.toml"
ALPHABET_SFT = ROOT / "configs" / "vf-sft" / "tiny-alphabet-sort.toml"


def _workspace(tmp_path: Path, *configs: Path) -> Path:
    """A copy of the repo's configs in a fresh directory, so the run builds its own tiny model and SFT checkpoint."""
    for cfg in configs:
        dest = tmp_path / cfg.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(cfg, dest)
    return tmp_path


def test_demo_configs_agree_and_plan_sft_first(tmp_path):
    rl, sft = tomllib.loads(DEMO.read_text()), tomllib.loads(DEMO_SFT.read_text())
    # RL must start from the prompts SFT trained on, or the warm-start is wasted.
    assert rl["env"]["args"] == sft["env"]["args"] and rl["tiny"] == sft["tiny"]
    assert (DEMO.parent / rl["sft"]["config"]).resolve() == DEMO_SFT.resolve()  # relative to the config file
    assert rl["eval"]["before"] and rl["eval"]["after"] and rl["eval"]["num_examples"] >= 100
    ws = _workspace(tmp_path, DEMO, DEMO_SFT)
    r, pid = run_command("vf-rl", "@", "configs/vf-rl/tiny-reverse-text.toml", "--dry-run", cwd=ws)
    assert r.returncode == 0, r.stderr
    assert "# SFT warm-start (runs first, a process of its own" in r.stdout
    assert "outputs/sft-tiny-reverse-text/final" in r.stdout
    assert "no CUDA devices: CPU engine" in r.stdout
    assert not (ws / "outputs").exists() or not any((ws / "outputs").rglob("*.safetensors"))  # dry run trains nothing


def test_full_finetuning_variant_differs_only_in_the_policy():
    """The demo trains LoRA; its full fine-tuning alternative must be the same run otherwise (same warm-start,
    prompts, sampling, eval), or comparing the two says nothing."""
    lora, full = tomllib.loads(DEMO.read_text()), tomllib.loads(DEMO_FULL.read_text())
    assert lora["trainer"]["args"]["use_lora"] is True and full["trainer"]["args"]["use_lora"] is False
    policy_keys = {"use_lora", "learning_rate", "run_name"} | {
        k for k in lora["trainer"]["args"] if k.startswith("lora")
    }
    strip = lambda cfg: {k: v for k, v in cfg["trainer"]["args"].items() if k not in policy_keys}  # noqa: E731
    assert strip(lora) == strip(full)
    assert {k: v for k, v in lora.items() if k != "trainer"} == {k: v for k, v in full.items() if k != "trainer"}


def test_tiny_alphabet_sort_runs_end_to_end(tmp_path):
    """The multi-turn pipeline in CI time: the demo's config without its warm-start (the slow test runs it whole)."""
    ws = _workspace(tmp_path, ALPHABET)
    cfg = ws / "configs" / "vf-rl" / "tiny-alphabet-sort.toml"
    text = cfg.read_text()
    no_sft = re.sub(r"(?ms)^\[sft\]\n.*?(?=^\[|\Z)", "", text)  # the [sft] table, up to the next one
    assert "[sft]" in text and "[sft]" not in no_sft and tomllib.loads(no_sft)["env"] == tomllib.loads(text)["env"]
    cfg.write_text(no_sft)  # RL from the tiny model itself
    r, pid = run_command(
        "vf-rl",
        "@",
        "configs/vf-rl/tiny-alphabet-sort.toml",
        "--trainer.args.max_steps",
        "2",
        "--eval.num_examples",
        "4",
        "--eval.base",
        "false",
        "--eval.greedy",
        "false",
        "--trainer.args.batch_size",
        "16",
        "--trainer.args.micro_batch_size",
        "16",
        "--trainer.args.rollouts_per_example",
        "4",
        cwd=ws,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = ws / "outputs" / "tiny-alphabet-sort"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "reward" in row]
    assert [row["step"] for row in steps] == [1, 2]
    # two planned turns -> two training samples per rollout (one per assistant turn)
    assert all(row["samples"] == 2 * (row["rollouts"] - row["rollouts_errored"]) for row in steps)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_reward_before"] is not None and summary["eval_reward_after"] is not None
    assert not survivors(pid)


def test_alphabet_sort_demo_configs_agree():
    rl, sft = tomllib.loads(ALPHABET.read_text()), tomllib.loads(ALPHABET_SFT.read_text())
    assert rl["env"]["args"] == sft["env"]["args"] and rl["tiny"] == sft["tiny"]
    assert (ALPHABET.parent / rl["sft"]["config"]).resolve() == ALPHABET_SFT.resolve()
    assert rl["eval"]["base"] and rl["eval"]["greedy"]  # the shares the summary reports
    assert sft["dataset"]["replies"] == "alphabet_sort:untagging_teacher_replies"


@pytest.mark.parametrize(("rl_path", "teacher"), [(DEMO, "reverse_text:lazy_teacher_replies"), (ALPHABET, None)])
def test_demos_warm_start_on_a_wrong_teacher_and_sample_at_one(rl_path, teacher):
    """What makes RL's share RL's: the warm-start learns from a teacher that is wrong in a systematic way, and RL
    samples (and is evaluated) at temperature 1.0, where it cannot gain by sharpening a hotter sampler; the evals
    report untrained / warm-start / RL, sampled and greedy, and the curve gets held-out points."""
    rl = tomllib.loads(rl_path.read_text())
    sft = tomllib.loads((rl_path.parent / rl["sft"]["config"]).read_text())
    assert "teacher" in sft["dataset"]["replies"] and (teacher is None or sft["dataset"]["replies"] == teacher)
    args = rl["trainer"]["args"]
    assert args["temperature"] == 1.0 and rl["eval"].get("temperature") is None
    assert rl["eval"]["base"] and rl["eval"]["greedy"] and rl["eval"]["before"] and rl["eval"]["after"]
    assert args["eval_strategy"] == "steps" and args["eval_steps"] < args["max_steps"]


def _rl_shares(ws: Path, run: str) -> dict:
    """summary.json, checked for every number issue 56 asks the demos to report, and the held-out points on the
    curve's data."""
    out = ws / "outputs" / run
    summary = json.loads((out / "summary.json").read_text())
    for kind in ("eval_reward", "eval_greedy_reward", "eval_perfect", "eval_greedy_perfect"):
        for when in ("base", "before", "after"):
            assert summary[f"{kind}_{when}"] is not None, (kind, when, summary)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "eval/reward" in r]) >= 2  # held-out reward during RL, on the curve
    assert (out / "reward_curve.png").stat().st_size > 1000
    return summary


@pytest.mark.slow
@pytest.mark.timeout(2400)  # 9 min idle, 22-24 with both cores busy: past the suite's 300 s default
def test_multi_turn_demo_learns(tmp_path):
    """Issue 56 on the multi-turn demo, from nothing: RL's own share of held-out reward, sampled at 1.0 and greedy,
    at least half its goal (+0.25 sampled, +0.15 greedy), and the summary reports every share."""
    ws = _workspace(tmp_path, ALPHABET, ALPHABET_SFT)
    t0 = time.perf_counter()
    r, pid = run_command("vf-rl", "@", "configs/vf-rl/tiny-alphabet-sort.toml", cwd=ws, timeout=2400)
    elapsed = time.perf_counter() - t0
    (tmp_path / "vf-rl.log").write_text(f"rc={r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}")
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"
    summary = _rl_shares(ws, "tiny-alphabet-sort")
    print(f"multi-turn demo: {elapsed:.0f}s, {summary}")
    assert summary["eval_reward_delta"] >= 0.125, summary
    assert summary["eval_greedy_reward_delta"] >= 0.075, summary
    assert summary["eval_reward_sft_delta"] > 0, summary  # the warm-start taught the format
    assert not survivors(pid)


@pytest.mark.slow
@pytest.mark.timeout(2400)  # 2.5 min idle, 3-4 with other jobs: past the suite's 300 s default
def test_demo_learns(tmp_path):
    """The README's main job, from nothing: RL's own share of held-out reward greedy at least half issue 56's goal
    (+0.15), and sampled at 1.0 above the warm-start."""
    ws = _workspace(tmp_path, DEMO, DEMO_SFT)
    t0 = time.perf_counter()
    r, pid = run_command("vf-rl", "@", "configs/vf-rl/tiny-reverse-text.toml", cwd=ws, timeout=2400)
    elapsed = time.perf_counter() - t0
    (tmp_path / "vf-rl.log").write_text(f"rc={r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}")
    tail = f"rc={r.returncode} (full output: {tmp_path / 'vf-rl.log'})\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"
    assert r.returncode == 0, tail
    out = ws / "outputs" / "tiny-reverse-text"
    assert (out / "summary.json").exists(), tail
    summary = _rl_shares(ws, "tiny-reverse-text")
    print(f"demo: {elapsed:.0f}s, {summary}")
    assert summary["eval_greedy_reward_delta"] >= 0.075, summary
    assert summary["eval_reward_delta"] > 0, summary
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"reward"' in x]
    max_steps = tomllib.loads(DEMO.read_text())["trainer"]["args"]["max_steps"]
    assert steps[:max_steps] == list(range(1, max_steps + 1))
    assert "eval reward: before RL" in r.stdout and "vf-rl: done." in r.stdout
    assert not survivors(pid)
