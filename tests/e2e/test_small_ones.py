"""Issue 55's smaller items, each run as a user runs it: vf-sft takes `--wandb.*` as vf-rl does, a missing config
file names where it was looked for, the prime-rl refusal names prime-rl's own command, `RLTrainer(model="tiny")`
points at the tiny-model builder, `lora_*` keys with use_lora = false are named, RLConfig's max_tokens default is
the documented one, and a fixed server port is printed as itself in the trainer's command."""

from __future__ import annotations

import textwrap

import pytest
from procs import ROOT, run_command

from verifiers_rl.config.rl_config import RLConfig


def _write(tmp_path, text: str, name: str = "cfg.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_vf_sft_takes_wandb_overrides_as_vf_rl_does(tmp_path, tiny_model_dir):
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb_files import _records, history, offline_run

    cfg = _write(
        tmp_path,
        f"""
        model = "{tiny_model_dir}"
        [dataset]
        env = "reverse-text"
        num_examples = 16
        [env.args]
        num_train_examples = 16
        [trainer.args]
        output_dir = "{tmp_path / "sft"}"
        per_device_train_batch_size = 8
        max_length = 128
        logging_steps = 1
        """,
    )
    wandb = ("--wandb.project", "sft-proj", "--wandb.mode", "offline", "--wandb.dir", tmp_path)
    r, _ = run_command("vf-sft", "@", cfg, *wandb, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    run = offline_run(tmp_path)
    assert any("train/loss" in row for row in history(run))
    [log] = run.glob("run-*.wandb")
    records = [pb.Record.FromString(raw) for raw in _records(log)]
    assert any(rec.WhichOneof("record_type") == "run" and rec.run.project == "sft-proj" for rec in records)
    r, _ = run_command("vf-sft", "@", cfg, "--wandb.projekt", "x", "--dry-run")
    assert r.returncode == 2 and "trainer.args.wandb: unknown key(s) projekt; allowed: project" in r.stderr


def test_a_missing_config_names_where_it_was_looked_for(tmp_path):
    r, _ = run_command("vf-rl", "@", "configs/nope.toml", "--dry-run", cwd=tmp_path)
    assert r.returncode == 2
    assert f"config file 'configs/nope.toml' does not exist (looked for {tmp_path}/configs/nope.toml" in r.stderr


def test_the_prime_rl_refusal_names_prime_rls_command(tmp_path):
    cfg = _write(tmp_path, "inference_gpu_ids = [0]\n[orchestrator]\nbatch_size = 8\n")
    r, _ = run_command("vf-rl", "@", cfg)
    assert r.returncode == 2 and "(`uv run rl @ FILE`, as prime-rl's docs say)" in r.stderr


def test_rltrainer_model_tiny_points_to_the_builder(tmp_path):
    from rl_envs import reverse_env

    from verifiers_rl.trainer import RLTrainer

    with pytest.raises(ValueError, match=r"model='tiny' is vf-rl's config shorthand.*save_tiny_model"):
        RLTrainer(model="tiny", env=reverse_env(), args=RLConfig(output_dir=str(tmp_path), use_cpu=True))


def test_lora_keys_without_lora_are_named(tmp_path, tiny_model_dir):
    cfg = _write(
        tmp_path,
        f"""
        model = "{tiny_model_dir}"
        [env]
        id = "reverse-text"
        [trainer.args]
        use_lora = false
        lora_rank = 16
        lora_alpha = 32
        """,
    )
    r, _ = run_command("vf-rl", "@", cfg, "--dry-run")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "note: use_lora = false (full fine-tuning): lora_alpha, lora_rank are ignored" in r.stderr
    with pytest.warns(UserWarning, match=r"use_lora=False \(full fine-tuning\): lora_rank is ignored"):
        RLConfig(output_dir=str(tmp_path), use_lora=False, lora_rank=4, use_cpu=True)


def test_max_tokens_default_is_the_documented_one(tmp_path):
    assert RLConfig(output_dir=str(tmp_path), use_cpu=True).max_tokens is None
    doc = (ROOT / "docs" / "coming-from-verifiers.md").read_text()
    assert "`max_tokens` defaults to None" in doc and "set `max_tokens = 512`" in doc


def test_a_fixed_server_port_is_printed_as_itself(tmp_path, tiny_model_dir):
    cfg = _write(tmp_path, f'model = "{tiny_model_dir}"\n[env]\nid = "reverse-text"\n[inference]\nport = 8123\n')
    r, _ = run_command("vf-rl", "@", cfg, "--dry-run", "--gpus", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--port 8123" in r.stdout and "<free port>" not in r.stdout
    # the trainer's command carries no address: the server's (this port) reaches it in the plan, with its config
    trainer = r.stdout.split("# trainer (1 process", 1)[1].splitlines()[1]
    assert trainer.endswith("-m verifiers_rl.scripts.train --from-plan") and str(cfg) not in trainer


def test_the_cpu_engine_s_ignored_flags_are_named_in_the_plan(tmp_path, tiny_model_dir):
    text = f'model = "{tiny_model_dir}"\n[env]\nid = "reverse-text"\n[inference.args]\nenforce_eager = true\n'
    r, _ = run_command("vf-rl", "@", _write(tmp_path, text), "--dry-run")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "the CPU engine ignores vLLM-only flags: --enforce-eager" in r.stdout
