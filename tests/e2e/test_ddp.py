"""DDP over gloo: one orchestrator on rank 0, the batch split across ranks, globally normalised loss.

Two processes must take the same optimizer steps as one process on the same rollouts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ddp_train.py"


def _rewards_losses(out):
    rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [(r["reward"], r["loss"]) for r in rows if "reward" in r]


@pytest.mark.slow  # CI time: test_sharded.py's two-node DDP case checks the same agreement and the final model
def test_two_process_ddp_matches_single_process(tiny_model_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    r1 = subprocess.run(
        [sys.executable, str(SCRIPT), tiny_model_dir, str(single)], capture_output=True, text=True, timeout=300, env=env
    )
    assert r1.returncode == 0, r1.stderr[-3000:]
    # accelerate 1.x sends `--cpu` to its single-process launcher (multi-CPU there means mpirun); its torchrun
    # launcher starts two gloo ranks, and use_cpu=True in the config keeps them on the CPU.
    launcher = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ]
    r2 = subprocess.run(
        [*launcher, str(SCRIPT), tiny_model_dir, str(ddp)], capture_output=True, text=True, timeout=400, env=env
    )
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "WORLD 2" in r2.stdout
    evals = [json.loads((ddp / f"eval-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert evals[0]["reward"] == evals[1]["reward"]  # same metrics on both ranks
    assert [e["has_server"] for e in evals] == [True, False]  # only rank 0 ever held a server
    a, b = _rewards_losses(single), _rewards_losses(ddp)
    assert len(a) == len(b) == 2
    for (ra, la), (rb, lb) in zip(a, b):
        assert ra == rb  # same seeds, same weights -> same rollouts
        assert abs(la - lb) < 1e-5, (la, lb)
    wa, wb = torch.load(single / "lora.pt"), torch.load(ddp / "lora.pt")
    assert wa.keys() == wb.keys()
    # Adam divides by sqrt(v): an element whose gradient is ~0 (lora_A early on, while B is still ~0) moves by up to
    # lr either way on float noise from the all-reduce (1e-5 was seen on one element of 512). 1e-4 is 50x below one
    # step at lr=5e-3, so a wrong gradient still fails here.
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-4), (k, (wa[k] - wb[k]).abs().max())
    # train() wrote final/ on rank 0 while rank 1 waited: the same merged model as the single process's
    fa, fb = (load_file(str(run / "final" / "model.safetensors")) for run in (single, ddp))
    assert fa.keys() == fb.keys() and (ddp / "final" / "vf_rl_export.json").exists()
    assert not list(ddp.glob(".final*"))
    for k in fa:
        assert torch.allclose(fa[k], fb[k], atol=1e-4), (k, (fa[k] - fb[k]).abs().max())


def test_vf_rls_ranks_train_from_its_plan_without_the_config_file(tiny_model_dir, tmp_path, monkeypatch):
    """vf-rl's trainer processes (two DDP ranks under `accelerate launch`, as vf-rl starts them for two trainer
    GPUs) train with the config, model and RLConfig vf-rl resolved and handed them in the plan: the TOML file is
    gone before they start, and the command line's override still holds."""
    from runs import write_cfg

    from verifiers_rl.config.run_file import RunFile
    from verifiers_rl.plan.run import probe_machine
    from verifiers_rl.scripts import rl
    from verifiers_rl.scripts.rl_plan import build_plan, launcher_args, trainer_command

    path = write_cfg(tmp_path, tiny_model_dir, steps=3)
    plan = build_plan(RunFile.read(path, ["--trainer.args.max_steps", "1"]), probe_machine(0), dry_run=False)
    assert not plan.trainer_cmd  # on a CPU vf-rl trains in its own process; here in the processes GPUs would get
    plan.trainer_cmd = trainer_command(launcher_args(2))
    path.unlink()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert rl.run(plan) == 0
    out = Path(plan.output_dir)
    assert len(_rewards_losses(out)) == 1  # max_steps from the command line, not the file's 3
    assert (out / "final" / "vf_rl_export.json").exists()  # rank 0 wrote the final model
