"""`vf-rl`'s SFT warm-start runs as a process of its own, on the trainer's GPUs only (in vf-rl's process, Trainer
would take every visible GPU with DataParallel and keep its CUDA context for the whole run); a failing one is one
line and a non-zero exit. No GPU here: a plan for 2 GPUs is launched through vf-rl's own `run()` with process
creation recorded, and the warm-start child really runs (on the CPU, as it would on a CPU-only machine).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import textwrap

from verifiers_rl.config.run_file import RunFile
from verifiers_rl.scripts.rl_plan import build_plan
from verifiers_rl.scripts.sft import sft_command
from verifiers_rl.serving.launcher import _die_with_parent


def _configs(tmp_path, model: str) -> tuple:
    data = tmp_path / "pairs.jsonl"
    pair = {"prompt": [{"role": "user", "content": "abc"}], "completion": [{"role": "assistant", "content": "cba"}]}
    data.write_text((json.dumps(pair) + "\n") * 8)
    sft = tmp_path / "sft.toml"
    sft.write_text(textwrap.dedent(f"""
        model = "{model}"
        [dataset]
        path = "{data}"
        [trainer.args]
        output_dir = "{tmp_path / "sft"}"
        per_device_train_batch_size = 8
        max_length = 64
        max_steps = 1
        """))  # fmt: skip
    rl = tmp_path / "rl.toml"
    rl.write_text(textwrap.dedent(f"""
        model = "{model}"
        output_dir = "{tmp_path / "out"}"
        [sft]
        config = "sft.toml"
        [env]
        id = "reverse-text"
        [trainer.args]
        use_lora = false
        batch_size = 8
        rollouts_per_example = 4
        micro_batch_size = 4
        max_seq_len = 256
        """))  # fmt: skip
    return rl, sft


def _plan(rl, gpus: int):
    from verifiers_rl.plan.run import probe_machine

    return build_plan(RunFile.read(rl), probe_machine(gpus, 80), dry_run=True)


def test_the_warm_start_is_a_child_on_the_trainers_gpus(tmp_path, tiny_model_dir, monkeypatch):
    from verifiers_rl.scripts import rl
    from verifiers_rl.serving.launcher import InferenceServer

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    rl_cfg, sft_cfg = _configs(tmp_path, tiny_model_dir)
    plan = _plan(rl_cfg, gpus=2)  # GPU 0 serves, GPU 1 trains
    assert plan.gpus.trainer == [1] and not plan.sft.done
    started: list = []
    real_popen = subprocess.Popen

    def popen(cmd, **kw):
        role = "sft" if "verifiers_rl.scripts.sft" in cmd else "server" if "inference.server" in str(cmd) else "trainer"
        started.append((role, list(cmd), {**(kw.get("env") or {}), "preexec_fn": kw.get("preexec_fn")}))
        if role == "sft":  # the real warm-start, on the CPU: this machine has no GPU 1
            return real_popen(cmd, **{**kw, "env": {**kw["env"], "CUDA_VISIBLE_DEVICES": ""}})
        return real_popen(["sleep", "30"] if role == "server" else ["true"], start_new_session=True)

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(InferenceServer, "_wait_healthy", lambda self: None)
    monkeypatch.setattr(rl, "load_env", lambda cfg: None)
    assert rl.run(plan) == 0
    assert [role for role, _, _ in started] == ["sft", "server", "trainer"]  # the warm-start first, then the run
    _, cmd, env = started[0]
    assert cmd == sft_command(str(sft_cfg)) and env["CUDA_VISIBLE_DEVICES"] == plan.visible(plan.gpus.trainer) == "1"
    assert env["preexec_fn"] is _die_with_parent  # vf-rl killed outright takes it along
    final = tmp_path / "sft" / "final"
    assert plan.model == str(final) and (final / "model.safetensors").exists()
    # Trainer trains with use_cache=False; the warm-started model generates with the cache, as its base did
    assert json.loads((final / "config.json").read_text())["use_cache"] is True


def test_a_failing_warm_start_is_one_line_and_a_nonzero_exit(tmp_path, tiny_model_dir, monkeypatch, capfd):
    """The child's own error stays above; vf-rl adds one line with its exit code and starts nothing after it."""
    import sys

    from verifiers_rl.scripts import rl, sft

    rl_cfg, _ = _configs(tmp_path, tiny_model_dir)
    failing = [sys.executable, "-c", "import sys; sys.exit('vf-sft: error: the dataset is empty')"]
    monkeypatch.setattr(sft, "sft_command", lambda path: failing)  # a child that fails as vf-sft fails, at once
    monkeypatch.setattr(rl, "load_env", lambda cfg: None)
    code = rl.run_command(["@", str(rl_cfg)])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-2:] == [
        "vf-sft: error: the dataset is empty",
        "vf-rl: error: the SFT warm-start failed (exit code 1; its output is above): CUDA_VISIBLE_DEVICES= "
        + shlex.join(failing),
    ]
    assert not (tmp_path / "out" / "logs").exists()  # no server was started after it
