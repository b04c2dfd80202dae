"""A user's second run (issue 55): the rerun after they changed something, run as they type it.

Resume is decided from what the checkpoint was trained with (export/run_settings.py): the same settings resume and
say so; changed settings stop in one line naming each key, both values and the ways on; a finished run says so and
starts nothing; `--dry-run` prints which of these happens."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from procs import run_command, survivors
from runs import steps, write_cfg

from verifiers_rl.export.reward_curve import read_metrics


def _error_line(r, prog="vf-rl") -> str:
    lines = [x for x in r.stderr.splitlines() if x.startswith(f"{prog}: error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return lines[0]


@pytest.mark.timeout(900)  # seven runs of the command
def test_an_edited_config_never_resumes_with_the_old_settings(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    cfg = write_cfg(
        tmp_path,
        tiny_model_dir,
        steps=2,
        save_steps=1,
        extra="[eval]\nbefore = true\nnum_examples = 2\n[inference.args]\nenforce_eager = true\n",
    )
    r, _ = run_command("vf-rl", "@", cfg, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # a CPU run starts without DeepSpeed's accelerator notice or datasets' progress bars
    assert "Setting accelerator to CPU" not in r.stdout + r.stderr and "Map:" not in r.stderr, r.stderr[-3000:]
    assert "vf-rl: the CPU engine ignores vLLM-only flags: --enforce-eager" in r.stdout  # not only in its log
    # the console's line per step (a log, not a terminal, gets one each) in the tutorial's words
    lines = re.findall(r"^step (\d)/2  reward \S+  loss \S+  entropy \S+  importance ratio \S+  learning rate (\S+)  ",
                       r.stdout, re.M)  # fmt: skip
    assert lines == [("1", "1.00e-05"), ("2", "1.00e-05")], r.stdout[-3000:]

    # the same command again: the run is finished, nothing starts
    r, pid = run_command("vf-rl", "@", cfg, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "is finished: checkpoint-2 is step 2 of max_steps 2, nothing to train" in r.stdout
    assert "starting the cpu inference server" not in r.stdout and not survivors(pid)

    # the tutorial's edit: a new learning rate. The dry run and the run stop with the same one line
    edit = ("--trainer.args.learning_rate", "2e-3", "--trainer.args.max_steps", "3")
    dry, _ = run_command("vf-rl", "@", cfg, *edit, "--dry-run")
    r, pid = run_command("vf-rl", "@", cfg, *edit)
    assert dry.returncode == r.returncode == 2, r.stderr[-3000:]
    line = _error_line(r)
    assert line == _error_line(dry)
    assert f"{out}/checkpoint-2 was trained with other settings: learning_rate 1e-05 -> 0.002" in line, line
    assert 'a new run_name (or output_dir) for a new run, on_settings_change = "continue"' in line
    assert 'on_settings_change = "restart"' in line and not survivors(pid)

    # raising max_steps alone resumes, saying with which settings; the dry run says so first
    more = ("--trainer.args.max_steps", "3")
    dry, _ = run_command("vf-rl", "@", cfg, *more, "--dry-run")
    assert f"resumes from {out}/checkpoint-2 (step 2 of 3) with the settings it was trained with" in dry.stdout
    r, _ = run_command("vf-rl", "@", cfg, *more, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from {out}/checkpoint-3" not in r.stderr
    assert f"resuming from {out}/checkpoint-2 (step 2 of 3) with the settings it was trained with" in r.stderr
    assert sum("eval_before/reward" in row for row in read_metrics(out)) == 1  # not evaluated (and logged) again

    # continue with the new rate: the new steps train at it, and the run record and card say from when
    go_on = ("--trainer.args.learning_rate", "2e-3", "--trainer.args.max_steps", "4")
    r, _ = run_command("vf-rl", "@", cfg, *go_on, "--trainer.args.on_settings_change", "continue", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'with new values (on_settings_change = "continue"): learning_rate 1e-05 -> 0.002' in r.stderr
    rates = {row["step"]: row["learning_rate"] for row in read_metrics(out) if "learning_rate" in row}
    assert rates == {1: 1e-05, 2: 1e-05, 3: 1e-05, 4: 2e-3}, rates
    assert steps(out) == [1, 2, 3, 4]
    record = json.loads((out / "final" / "vf_rl_run.json").read_text())
    assert record["settings"]["learning_rate"] == 2e-3
    assert record["settings_changes"] == [{"step": 3, "changes": {"learning_rate": [1e-05, 2e-3]}}]
    assert (
        "From step 3 on, this run trained with new values: `learning_rate` 1e-05 -> 0.002"
        in (out / "final" / "README.md").read_text()
    )

    # a LoRA rank cannot continue from the checkpoint: the line says so; restart starts over
    rank = ("--trainer.args.lora_rank", "4", "--trainer.args.max_steps", "1")
    r, _ = run_command("vf-rl", "@", cfg, *rank, "--trainer.args.on_settings_change", "continue", "--dry-run")
    assert r.returncode == 2
    assert 'on_settings_change = "continue" cannot (lora_rank changed' in _error_line(r)
    r, _ = run_command("vf-rl", "@", cfg, *rank, "--trainer.args.on_settings_change", "restart", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'over (on_settings_change = "restart"; changed: learning_rate 0.002 -> 1e-05, lora_rank 8 -> 4' in r.stdout
    assert steps(out) == [1]
    assert json.loads((out / "checkpoint-1" / "vf_rl_run.json").read_text())["settings"]["lora_rank"] == 4


def test_python_resume_checks_the_settings_before_anything_starts(tiny_model_dir, tmp_path):

    from rl_envs import reverse_env
    from runs import tiny_rl_config

    from verifiers_rl.errors import TrainingError
    from verifiers_rl.trainer import RLTrainer

    def trainer(**kw):
        args = tiny_rl_config(tmp_path, max_steps=1, save_strategy="steps", save_steps=1, **kw)
        return RLTrainer(model=tiny_model_dir, env=reverse_env(), args=args)

    first = trainer()
    first.train()
    first.close()
    edited = trainer(learning_rate=1e-2, lora_alpha=16)
    with pytest.raises(TrainingError) as e:
        edited.train(resume_from_checkpoint=True)
    assert "checkpoint-1 was trained with other settings: learning_rate 0.005 -> 0.01, lora_alpha 8 -> 16;" in str(
        e.value
    )
    assert edited.runtime.session.process is None  # nothing started
    again = trainer()
    assert again.train(resume_from_checkpoint=True) is None  # finished: trains nothing, starts nothing
    assert again.runtime.session.process is None and again.state.global_step == 0


def test_every_path_follows_the_config_from_any_directory(tmp_path, tiny_model_dir):
    """One rule (docs/configuration.md): a path a config names is relative to the config's folder; what it does not
    name goes to its workspace's outputs/ (the folder above configs/). The warm-start done from the workspace is
    found from elsewhere, and the plan prints the same absolute outputs from both."""
    ws, elsewhere = tmp_path / "ws", tmp_path / "elsewhere"
    (ws / "configs" / "vf-rl").mkdir(parents=True)
    (ws / "configs" / "vf-sft").mkdir()
    elsewhere.mkdir()
    (ws / "configs" / "vf-sft" / "warm.toml").write_text(
        f'model = "{tiny_model_dir}"\n[dataset]\nenv = "reverse-text"\n'
    )
    rl = ws / "configs" / "vf-rl" / "run.toml"
    rl.write_text(
        'model = "tiny"\nrun_name = "run"\n[sft]\nconfig = "../vf-sft/warm.toml"\n[env]\nid = "reverse-text"\n'
    )
    done = ws / "outputs" / "sft-warm" / "final"  # the warm-start, as a run from the workspace left it
    shutil.copytree(tiny_model_dir, done)
    plans = [run_command("vf-rl", "@", path, "--dry-run", cwd=cwd)[0] for path, cwd in ((rl.relative_to(ws), ws),
                                                                                        (rl, elsewhere))]  # fmt: skip
    for r in plans:
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"# SFT warm-start (done, reused, a process of its own -> {done})" in r.stdout
        assert f"# outputs\n{ws}/outputs/run (final/" in r.stdout and f"a new run in {ws}/outputs/run" in r.stdout
    named = run_command("vf-rl", "@", rl, "--output_dir", "../../runs/x", "--dry-run", cwd=elsewhere)[0]
    assert f"# outputs\n{ws}/runs/x (final/" in named.stdout, named.stderr[-2000:]
    # an input that is only where the command runs (the old rule) is named, not read from there
    (elsewhere / "mine.toml").write_text((ws / "configs" / "vf-sft" / "warm.toml").read_text())
    r, _ = run_command("vf-rl", "@", rl, "--sft.config", "mine.toml", "--dry-run", cwd=elsewhere)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"is not in {ws}/configs/vf-rl (a path in a config is relative to the config's folder)" in _error_line(r)
