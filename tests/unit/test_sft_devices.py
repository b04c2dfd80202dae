"""Issue 54 item 5: the SFT warm-start trains on one GPU, never nn.DataParallel over the trainer's GPUs.

No GPU here: the devices are faked (torch.cuda's answers, the plan's probe) and nothing starts on one. `vf-rl`'s own
`run()` launches the warm-start with process creation recorded; the vf-sft process's own settings are built as it
builds them, with two GPUs visible.
"""

from __future__ import annotations

import shutil
import subprocess

import torch
from test_one_plan import _config, _launch, _plan

from verifiers_rl.config.run_file import RunFile
from verifiers_rl.plan.run import PLAN_ENV
from verifiers_rl.scripts.rl_plan import render
from verifiers_rl.scripts.sft import sft_args


def test_vf_rl_starts_the_warm_start_on_one_of_the_trainers_gpus(tmp_path, tiny_model_dir, monkeypatch):
    """4 GPUs: 2 for vLLM, 2 trainer ranks. The warm-start's process sees the trainer's first GPU only, and the
    dry run prints the command vf-rl runs."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(PLAN_ENV, raising=False)
    sft_cfg = tmp_path / "sft.toml"
    sft_cfg.write_text(
        f'model = "{tiny_model_dir}"\n[dataset]\nenv = "reverse-text"\n'
        f'[trainer.args]\noutput_dir = "{tmp_path / "sft-out"}"\n'
    )
    args = {"batch_size": 16, "rollouts_per_example": 4, "micro_batch_size": 2, "max_seq_len": 256}
    path = _config(tmp_path, tiny_model_dir, inference=2, trainer=2, args=args, tables=f'[sft]\nconfig = "{sft_cfg}"')
    plan = _plan(path, 4)
    assert plan.gpus.trainer == [2, 3] and not plan.sft.done

    started = []

    def sft_process(cmd, env, **kw):  # stands in for vf-sft: records how it starts, writes what it writes
        started.append((cmd, env))
        shutil.copytree(tiny_model_dir, plan.sft.final_dir)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", sft_process)
    _launch(plan, monkeypatch)
    (cmd, env), = started  # fmt: skip
    assert env["CUDA_VISIBLE_DEVICES"] == "2"  # before: "2,3", and Trainer's DataParallel over both
    printed = next(line for line in render(plan).splitlines() if line.startswith("CUDA_VISIBLE_DEVICES=2 "))
    assert printed.endswith(" ".join(cmd[-2:]))


def test_vf_sft_with_two_gpus_visible_trains_on_one(tmp_path, monkeypatch, capsys):
    """`vf-sft` run by hand on a machine with two GPUs visible: transformers counts both (n_gpu 2, which makes
    Trainer wrap the model in DataParallel); the settings vf-sft trains with count one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # two GPUs: the device is what is faked
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    from trl import SFTConfig

    assert SFTConfig(output_dir=str(tmp_path / "hf"), report_to="none", bf16=False).n_gpu == 2  # what transformers does
    sft = tmp_path / "sft.toml"
    sft.write_text('model = "tiny"\n[dataset]\nenv = "reverse-text"\n[trainer.args]\nbf16 = false\n')
    args, _ = sft_args(RunFile.read(sft, command="vf-sft"))
    assert args.n_gpu == 1 and str(args.device) == "cuda:0"
    assert "2 GPUs visible; training on cuda:0 only" in capsys.readouterr().out
