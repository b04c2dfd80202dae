"""vf-rl / vf-train / vf-sft / vf-rl setup, run as a user runs them (subprocesses, real server, real envs)."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
from procs import ROOT, run_command, survivors

# every FutureWarning / DeprecationWarning printed, each time (Python hides DeprecationWarnings of libraries)
SHOW_DEPRECATIONS = {"PYTHONWARNINGS": "always::FutureWarning,always::DeprecationWarning"}


def library_deprecations(stderr: str) -> list[str]:
    """Deprecation warnings printed from inside transformers, peft, accelerate or trl."""
    pattern = r"/(transformers|peft|accelerate|trl)/\S+:\d+: (FutureWarning|DeprecationWarning): .*"
    return [m.group(0) for m in re.finditer(pattern, stderr)]


def _write(tmp_path, text: str, name="cfg.toml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


TINY_RL = """
model = "{model}"
output_dir = "{out}"
[env]
id = "reverse-text"
[env.args]
num_train_examples = 32
num_eval_examples = 8
[inference]
engine = "cpu"
[trainer.args]
max_steps = 1
rollouts_per_example = 4
batch_size = 16
micro_batch_size = 8
max_tokens = 8
max_seq_len = 256
learning_rate = 1e-3
save_strategy = "no"
log_completions = false
[eval]
before = true
after = true
num_examples = 4
"""


@pytest.mark.parametrize(
    "body, message",
    [
        (
            "[trainer.args]\nbatch_size = 10\nrollouts_per_example = 4\n",
            "batch_size=10: must be a positive multiple of rollouts_per_example=4",
        ),
        (
            "[trainer.args]\nlearning_rat = 1e-4\n",
            "unknown key 'trainer.args.learning_rat' (did you mean 'learning_rate'?)",
        ),
        ("[trainr]\ngpus = 1\n", "unknown section [trainr] (did you mean 'trainer'?)"),
        ("[inference]\nengine = 'tpu'\n", "inference.engine='tpu': allowed: auto, cpu, vllm"),
        ("[inference]\ngpus = 'two'\n", "inference.gpus='two': expected int"),
    ],
)
def test_broken_config_is_one_clear_line(tmp_path, tiny_model_dir, body, message):
    cfg = _write(tmp_path, f'model = "{tiny_model_dir}"\n[env]\nid = "reverse-text"\n' + body)
    r, pid = run_command("vf-rl", "@", cfg)
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip() and "Warning" not in x and "warnings.warn" not in x]
    assert lines == [f"vf-rl: error: {lines[0].split('error: ', 1)[1]}"] and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not survivors(pid)


def test_missing_env_and_missing_file(tmp_path, tiny_model_dir):
    r, pid = run_command("vf-rl", "@", tmp_path / "nope.toml")
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    cfg = _write(tmp_path, f'model = "{tiny_model_dir}"\n')
    r, pid = run_command("vf-rl", "@", cfg)
    assert r.returncode == 2 and "missing required key [env] id" in r.stderr
    cfg = _write(
        tmp_path, TINY_RL.format(model=tiny_model_dir, out=tmp_path / "o").replace('"reverse-text"', '"no-such-env"')
    )
    r, pid = run_command("vf-rl", "@", cfg)
    assert r.returncode == 2 and "environment 'no-such-env' is not installed" in r.stderr
    assert "Traceback" not in r.stderr
    assert not survivors(pid)


def test_overrides_and_dry_run(tmp_path, tiny_model_dir):
    cfg = _write(tmp_path, TINY_RL.format(model=tiny_model_dir, out=tmp_path / "o"))
    r, pid = run_command("vf-rl", "@", cfg, "--dry-run", "--trainer.args.learning_rate", "3e-4", "--env.args.max_len=5")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout.split("# devices")[0].split("# resolved config", 1)[1])
    assert plan["trainer"]["args"]["learning_rate"] == 3e-4 and plan["env"]["args"]["max_len"] == 5
    assert "no CUDA devices: CPU engine" in r.stdout and "--engine cpu" in r.stdout
    assert not (tmp_path / "o").exists()  # a dry run runs nothing


def test_vf_rl_runs_end_to_end(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    cfg = _write(tmp_path, TINY_RL.format(model=tiny_model_dir, out=out))
    r, pid = run_command("vf-rl", "@", cfg, timeout=400, env=SHOW_DEPRECATIONS)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not library_deprecations(r.stderr)
    card = (out / "final" / "README.md").read_text()  # written after the eval after RL: the card has both
    assert "| eval_before | 0 |" in card and "| eval_after | 1 |" in card and "`reverse-text`" in card
    assert (out / "final" / "model.safetensors").exists() and (out / "final" / "adapter").is_dir()
    assert f"final model: {out / 'final'}" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_reward_before"] is not None and summary["eval_reward_after"] is not None
    assert (out / "reward_curve.png").stat().st_size > 1000
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward" in r] == [1]
    assert "vf-rl: done." in r.stdout
    assert not survivors(pid)


def test_vf_sft_writes_a_checkpoint_rl_can_use(tmp_path, tiny_model_dir):
    cfg = _write(
        tmp_path,
        f"""
        model = "{tiny_model_dir}"
        [dataset]
        env = "reverse-text"
        completion_template = "<reversed_text>{{answer}}</reversed_text>"
        num_examples = 32
        [env.args]
        num_train_examples = 32
        [trainer.args]
        output_dir = "{tmp_path / "sft"}"
        per_device_train_batch_size = 8
        max_length = 128
        learning_rate = 1e-3
        use_lora = true
        lora_rank = 4
        """,
        "sft.toml",
    )
    r, pid = run_command("vf-sft", "@", cfg, env=SHOW_DEPRECATIONS)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not library_deprecations(r.stderr)  # TRL's SFTConfig default and its peft wrap used to warn
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = tmp_path / "sft" / "final"
    model = AutoModelForCausalLM.from_pretrained(final)  # merged: a plain model, no adapter files needed
    assert not any("lora" in n for n, _ in model.named_parameters())
    assert AutoTokenizer.from_pretrained(final).chat_template
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert any((p - q).abs().max() > 0 for p, q in zip(model.parameters(), base.parameters()))
    bad = _write(
        tmp_path,
        f'model = "{tiny_model_dir}"\n[dataset]\nenv = "reverse-text"\n[trainer.args]\nnum_epochs = 1\n',
        "bad.toml",
    )
    r, pid = run_command("vf-sft", "@", bad)
    assert r.returncode == 2 and "unknown key 'trainer.args.num_epochs'" in r.stderr and "num_train_epochs" in r.stderr


def test_vf_train_against_a_running_server(tmp_path, tiny_model_dir):
    from verifiers_rl.serving.launcher import InferenceServer

    out = tmp_path / "train"
    cfg = _write(tmp_path, TINY_RL.format(model=tiny_model_dir, out=out))
    server = InferenceServer(tiny_model_dir, engine="cpu", output_dir=tmp_path / "srv")
    with server as client:
        r, pid = run_command(
            "vf-train", "@", cfg, "--inference.port", server.port, env={"VF_CONTROL_TOKEN": server.token}
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert client.weight_version() == "1"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward" in r] == [1]
    # vf-train runs the config's [eval] too (it is what vf-rl runs under accelerate for several trainer GPUs)
    assert any("eval_before/reward" in r for r in rows) and any("eval_after/reward" in r for r in rows)


def test_setup_lays_out_workspace_idempotently(tmp_path):
    ws = tmp_path / "ws"
    r, pid = run_command("vf-rl", "setup", ws)
    assert r.returncode == 0 and r.stdout.count("✓ created") == 9
    for rel in (
        "configs/endpoints.toml",
        "configs/vf-rl/alphabet-sort.toml",
        "configs/vf-rl/wordle.toml",
        "configs/vf-rl/reverse-text.toml",
        "environments/AGENTS.md",
    ):
        assert (ws / rel).exists(), rel
    r, pid = run_command("vf-rl", "setup", ws)
    assert r.stdout.count("✓ up to date") == 9
    edited = ws / "configs/vf-rl/gsm8k.toml"
    edited.write_text(edited.read_text() + "\n# mine\n")
    r, pid = run_command("vf-rl", "setup", ws)
    assert "kept (edited; --force to replace)" in r.stdout and edited.read_text().endswith("# mine\n")
    r, pid = run_command("vf-rl", "setup", ws, "--force")
    assert "✓ overwritten" in r.stdout and not edited.read_text().endswith("# mine\n")
    from verifiers_rl.scripts.setup import setup_workspace

    assert {s for _, s in setup_workspace(ws)} == {"unchanged"}


@pytest.fixture
def port_8000():
    """vf-vllm's default port, which configs/endpoints.toml names, for this test alone (tests/ports.py)."""
    from ports import default_port_exclusive

    with default_port_exclusive():
        yield


def test_setup_next_steps_run_as_printed(tmp_path, tiny_model_dir, port_8000):
    """`vf-rl setup`'s next steps, run as printed from the workspace: the example's dry run plans, and vf-eval -m local
    (verifiers' own, installed here) reads configs/endpoints.toml and evaluates the model the printed vf-vllm serves
    (with the tiny model in place of the example's, which this machine has no copy of)."""
    import shlex
    import subprocess

    from procs import BIN
    from waits import wait_healthy

    ws = tmp_path / "ws"
    r, _ = run_command("vf-rl", "setup", ws, cwd=tmp_path)
    steps = [shlex.split(line.split("#")[0]) for line in r.stdout.split("next:\n", 1)[1].splitlines()]
    assert steps[0] == ["cd", str(ws)] and not (ws / "configs" / "endpoints.py").exists()
    starts = (["vf-rl", "@"], ["vf-vllm", "--model"], ["vf-eval", "reverse-text"])
    plan, serve, evaluate = (next(s for s in steps if s[:2] == start) for start in starts)
    r, _ = run_command(*plan, cwd=ws)
    assert r.returncode == 0 and f"a new run in {ws}" in r.stdout, r.stderr[-2000:]
    serve[serve.index("--model") + 1] = tiny_model_dir
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen([str(BIN / serve[0]), *serve[1:], "--engine", "cpu"], stdout=log, stderr=log)
    try:
        wait_healthy("http://127.0.0.1:8000", proc=server, log=tmp_path / "server.log")
        env = {"VLLM_API_KEY": "", "OPENAI_API_KEY": ""}
        r, _ = run_command(*evaluate, "-n", "2", "-r", "1", "-t", "4", cwd=ws, env=env, timeout=300)
    finally:
        server.terminate()
        server.wait(30)
        log.close()
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "not found in endpoint registry" not in out and "no longer supported" not in out, out[-3000:]
    assert re.search(r"output_tokens \(avg\): [1-9]", out), out[-3000:]  # the rollouts reached the local server


def test_repo_configs_are_the_scaffold_templates():
    from verifiers_rl.scripts.setup import FILES, template

    for rel in FILES:
        if rel.startswith("configs/"):
            assert (ROOT / rel).read_text() == template(rel), rel


@pytest.mark.parametrize("name", ["alphabet-sort", "gsm8k", "math-python", "reverse-text", "wiki-search", "wordle"])
def test_gpu_configs_validate_and_plan(name):
    r, pid = run_command(
        "vf-rl", "@", ROOT / "configs" / "vf-rl" / f"{name}.toml", "--dry-run", "--gpus", "2", cwd=ROOT
    )
    assert r.returncode == 0, r.stderr
    assert "2 CUDA devices: inference on [0], trainer on [1]" in r.stdout
    assert "CUDA_VISIBLE_DEVICES=0" in r.stdout and "--engine vllm" in r.stdout
    # the trainer in a process of its own, narrowed to GPU 1 (vf-rl's own process sees both: cuda:0 is vLLM's)
    trainer = r.stdout.split("# trainer (1 process", 1)[1].splitlines()[1]
    assert trainer.startswith("CUDA_VISIBLE_DEVICES=1 ") and "verifiers_rl.scripts.train" in trainer


def test_config_specs_from_the_issue():
    import tomllib

    rt = tomllib.loads((ROOT / "configs/vf-rl/reverse-text.toml").read_text())
    a = rt["trainer"]["args"]
    assert rt["model"] == "Qwen/Qwen3-0.6B" and "sft" in rt
    assert a["batch_size"] // a["rollouts_per_example"] == 8 and a["rollouts_per_example"] == 16
    assert a["max_tokens"] == 128 and a["max_seq_len"] == 512
    al = tomllib.loads((ROOT / "configs/vf-rl/alphabet-sort.toml").read_text())
    a = al["trainer"]["args"]
    assert al["model"] == "Qwen/Qwen3-4B-Instruct-2507"
    assert (
        a["lora_rank"],
        a["lora_alpha"],
        a["max_steps"],
        a["batch_size"],
        a["rollouts_per_example"],
        a["max_seq_len"],
    ) == (32, 64, 100, 512, 8, 2048)
    assert al["env"]["args"] == {
        "min_turns": 3,
        "max_turns": 3,
        "min_names_per_turn": 1,
        "max_names_per_turn": 4,
        "similarity_power": 8,
        "power_per_turn": False,
    }
