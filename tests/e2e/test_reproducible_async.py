"""Reproducible async: with max_async_level = k, batch b is generated entirely by policy version max(0, b - k),
so the same seed gives the same rewards and losses whether the machine is idle or busy, and a resumed run
continues exactly, for k = 0, 1, 2."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest
from rl_envs import reverse_env

from verifiers_rl.trainer import RLConfig, RLTrainer


def _burn(stop) -> None:  # a CPU hog: what a busy machine looks like to the trainer and the server
    x = 0
    while not stop.is_set():
        for _ in range(10_000):
            x = (x * 31 + 7) % 1_000_003


def _run(model_dir, out: Path, k: int, steps: int = 4, resume=None, stop_after: int | None = None) -> list[dict]:
    args = RLConfig(
        output_dir=str(out), rollouts_per_example=4, batch_size=16, micro_batch_size=8, max_steps=steps,
        max_tokens=6, max_seq_len=160, learning_rate=5e-3, lora_rank=4, lora_alpha=8, use_cpu=True, seed=11,
        save_strategy="steps", save_steps=2, log_completions=False, max_async_level=k, temperature=1.0,
    )  # fmt: skip
    trainer = RLTrainer(model=model_dir, env=reverse_env(), args=args)
    try:
        if stop_after is not None:
            trainer.args.max_steps = trainer.state.max_steps = stop_after
        trainer.train(resume_from_checkpoint=resume)
    finally:
        trainer.close()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward" in r]


def _same(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        assert x["policy_version"] == y["policy_version"]
        assert x["reward"] == pytest.approx(y["reward"], abs=1e-9), (x["step"], x["reward"], y["reward"])
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5), (x["step"], x["loss"], y["loss"])


@pytest.mark.parametrize("k", [0, pytest.param(1, marks=pytest.mark.slow), 2])  # CI: sync and deepest async
def test_same_seed_same_run_on_an_idle_and_a_busy_machine(tiny_model_dir, tmp_path, k):
    idle = _run(tiny_model_dir, tmp_path / "idle", k)
    assert [r["policy_version"] for r in idle] == [max(0, b - k) for b in range(4)]  # logged per batch
    stop = mp.Event()
    hogs = [mp.Process(target=_burn, args=(stop,), daemon=True) for _ in range(os.cpu_count() or 2)]
    for h in hogs:
        h.start()
    try:
        busy = _run(tiny_model_dir, tmp_path / "busy", k)
    finally:
        stop.set()
        for h in hogs:
            h.join(10)
    _same(idle, busy)


def test_resume_is_exact_with_async_generation(tiny_model_dir, tmp_path):
    full = _run(tiny_model_dir, tmp_path / "full", 1)
    _run(tiny_model_dir, tmp_path / "split", 1, stop_after=2)
    resumed = _run(tiny_model_dir, tmp_path / "split", 1, resume=True)
    _same(full, resumed)
