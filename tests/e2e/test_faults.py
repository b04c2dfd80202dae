"""Fault injection: every fault ends cleanly — exit status, one line, no traceback, nothing left running,
checkpoints and metrics intact. Run alone with `pytest -m faults`.

Processes are found through the launcher's parent-pid marker (procs.survivors), never by name."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from procs import BIN, run_command, survivors
from runs import error_line as _error_line
from runs import server_pids as _server_pids
from runs import start as _start
from runs import steps as _steps
from runs import wait_for_step as _wait_for_step
from waits import wait_healthy

pytestmark = pytest.mark.faults

RUN = """
model = "{model}"
output_dir = "{out}"
[env]
id = "reverse-text"
[env.args]
num_train_examples = 32
num_eval_examples = 4
[inference]
engine = "cpu"
[trainer.args]
max_steps = {steps}
rollouts_per_example = 4
batch_size = 8
micro_batch_size = 4
max_tokens = 8
max_seq_len = 512
save_steps = {save_steps}
generation_timeout = {gen_timeout}
log_completions = false
max_async_level = 1
"""


def _cfg(tmp_path, model, steps=40, save_steps=2, gen_timeout=600, extra="", name="cfg.toml") -> Path:
    p = tmp_path / name
    text = RUN.format(model=model, out=tmp_path / "out", steps=steps, save_steps=save_steps, gen_timeout=gen_timeout)
    p.write_text(textwrap.dedent(text) + extra)
    return p


def _wait_survivors_gone(pid: int, timeout: float = 20) -> list[str]:
    deadline = time.monotonic() + timeout
    while survivors(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return survivors(pid)


# ---------------------------------------------------------------------------------------------- preemption


# SIGTERM's save, exit 143 and resume run in the fast suite as test_reliability's requeue test (twice over)
@pytest.mark.parametrize("sig, code", [pytest.param(signal.SIGTERM, 143, marks=pytest.mark.slow), (signal.SIGINT, 130)])
def test_signal_saves_the_last_step_and_resume_continues(tmp_path, tiny_model_dir, sig, code):
    from verifiers_rl.export.checkpoints import checkpoints, problem

    out = tmp_path / "out"
    cfg = _cfg(tmp_path, tiny_model_dir, steps=40, save_steps=100)  # no scheduled save before the signal
    proc = _start(cfg)
    _wait_for_step(proc, out, 3)
    t0 = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    assert time.monotonic() - t0 < 90
    assert "Traceback" not in err
    assert not _wait_survivors_gone(proc.pid)
    saved = checkpoints(out)
    assert saved, "no checkpoint after the signal"
    last = int(saved[0].name.split("-")[1])
    assert last == max(_steps(out)) and problem(saved[0], use_lora=True) is None
    assert not (out / "final").exists(), "a run stopped by a signal is not finished: no final/"
    name = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"  # the line says what was saved and how to go on
    assert f"stopped by {name} after step {last}: {out}/checkpoint-{last} is saved; run the same command again" in err
    # resume: picks up the checkpoint, each step appears once in metrics.jsonl
    r, pid = run_command("vf-rl", "@", cfg, "--trainer.args.max_steps", str(last + 2), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = _steps(out)
    assert steps == list(range(1, last + 3)), steps
    assert json.loads((out / "final" / "vf_rl_export.json").read_text())["step"] == last + 2


def test_second_signal_exits_at_once(tmp_path, tiny_model_dir):
    proc = _start(_cfg(tmp_path, tiny_model_dir))
    _wait_for_step(proc, tmp_path / "out", 1)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 143
    assert not _wait_survivors_gone(proc.pid)


# ---------------------------------------------------------------------------------------------- server faults


def test_frozen_server_ends_the_run_within_the_deadline(tmp_path, tiny_model_dir):
    proc = _start(_cfg(tmp_path, tiny_model_dir, gen_timeout=15))
    _wait_for_step(proc, tmp_path / "out", 1)
    servers = _server_pids(proc.pid)
    assert servers
    t0 = time.monotonic()
    for pid in servers:
        os.kill(pid, signal.SIGSTOP)
    _, err = proc.communicate(timeout=15 + 30 + 30)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1 and elapsed < 15 + 30 + 15, (proc.returncode, elapsed, err[-2000:])
    line = _error_line(err)
    assert "is stopped" in line and "inference.log" in line, line
    assert not _wait_survivors_gone(proc.pid)


def test_killed_server_without_restarts_is_one_line_with_its_log_and_the_resume(tmp_path, tiny_model_dir):
    from verifiers_rl.export.checkpoints import checkpoints, problem

    cfg = _cfg(tmp_path, tiny_model_dir, save_steps=100, extra="server_restarts = 0\n")  # restarts: test_reliability
    proc = _start(cfg)
    _wait_for_step(proc, tmp_path / "out", 1)
    for pid in _server_pids(proc.pid):
        os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-2000:]
    line = _error_line(err)
    assert "was killed by signal 9 (restarts are off: server_restarts=0)" in line and "inference.log" in line, line
    assert f"then run `vf-rl @ {cfg}` again: it resumes from the last checkpoint" in line, line
    assert "last log lines" in err  # the tail follows the line
    saved = checkpoints(tmp_path / "out")  # nothing lost: the last completed step is checkpointed
    assert saved and int(saved[0].name.split("-")[1]) == max(_steps(tmp_path / "out"))
    assert problem(saved[0], use_lora=True) is None
    assert not _wait_survivors_gone(proc.pid)


# ---------------------------------------------------------------------------------------------- listening surfaces


def test_weight_sync_store_listens_on_loopback_only_and_needs_the_run_key(tiny_model_dir, tmp_path):
    import datetime

    import torch.distributed as dist

    from verifiers_rl.serving.launcher import InferenceServer

    with InferenceServer(tiny_model_dir, engine="cpu", output_dir=tmp_path) as client:
        client.init_weight_transfer("gloo")
        port = client.sender.group.store.port
        with socket.socket() as s, pytest.raises(OSError):
            s.settimeout(2)
            s.connect(("127.0.0.2", port))  # another address of this machine: refused
        # a local peer without the run's key reaches the store but not the group's keys
        stranger = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=datetime.timedelta(seconds=5))
        stranger.set("verifiers_rl_weights/0", b"x")
        assert not stranger.check(["verifiers_rl_weights/0/0"])
        # the sync still works
        from verifiers_rl.tiny import build_tiny_model

        stats = client.update_weights(build_tiny_model()[0].named_parameters(), version=3)
        assert stats.version == 3 and client.weight_version() == "3"


def test_user_started_server_has_a_control_token(tiny_model_dir, tmp_path):
    import httpx

    from verifiers_rl.config.net import free_port
    from verifiers_rl.serving.auth import read_token_file

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VF_CONTROL_TOKEN"}
    proc = subprocess.Popen(
        [str(BIN / "vf-vllm"), "--engine", "cpu", "--model", tiny_model_dir, "--host", "0.0.0.0", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc=proc)
        token = read_token_file(port)
        assert token
        assert httpx.post(f"http://127.0.0.1:{port}/pause").status_code == 401  # any local process: refused
        ok = httpx.post(f"http://127.0.0.1:{port}/pause", headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert f"control token {token}" in out
    assert "listening on 0.0.0.0:" in out and "with NO API key" in out and "loopback clients only" in out
    assert read_token_file(port) is None  # removed on exit


# ---------------------------------------------------------------------------------------------- bad environments


BROKEN_ENVS = """
import verifiers as vf
from datasets import Dataset

def _ds(n=8, answer=True):
    rows = [{"question": f"say {i}", **({"answer": str(i)} if answer else {})} for i in range(n)]
    return Dataset.from_list(rows)

def raising(completion, **kw):
    raise ValueError("judge unreachable")

def returns_none(completion, **kw):
    return None

def reads_answer(completion, answer):
    return float(answer in str(completion))

class Broken(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kw):
        raise RuntimeError("tool server crashed")

def load_environment(kind: str = "raising"):
    if kind == "raising":
        return vf.SingleTurnEnv(dataset=_ds(), rubric=vf.Rubric(funcs=[raising]))
    if kind == "none":
        return vf.SingleTurnEnv(dataset=_ds(), rubric=vf.Rubric(funcs=[returns_none]))
    if kind == "no_answer":
        return vf.SingleTurnEnv(dataset=_ds(answer=False), rubric=vf.Rubric(funcs=[reads_answer]))
    if kind == "empty":
        return vf.SingleTurnEnv(dataset=_ds(0), rubric=vf.Rubric(funcs=[raising]))
    if kind == "no_prompt":
        env = vf.SingleTurnEnv(dataset=_ds(), rubric=vf.Rubric(funcs=[raising]))
        env.dataset = Dataset.from_list([{"text": "x"}] * 4)
        return env
    if kind == "env_response":
        return Broken(dataset=_ds(), rubric=vf.Rubric(funcs=[reads_answer]), max_turns=3)
    raise ValueError(kind)
"""


@pytest.fixture(scope="module")
def broken_env_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("envs")
    (root / "broken_env.py").write_text(BROKEN_ENVS)
    return root


@pytest.mark.parametrize(
    "kind, message",
    [
        ("raising", "every rollout failed (8 errored, 0 rejected; first: reward function raising raised ValueError: "
                    "judge unreachable)"),
        # -m slow for CI time: tests/unit/test_reward_checks.py checks these two on real environments, and their
        # way out is the one "raising" and "no_answer" take
        pytest.param("none", "reward function returns_none returned None, not a finite number", marks=pytest.mark.slow),
        ("no_answer", "reward function reads_answer reads `answer`, but the training dataset has no 'answer' column"),
        ("empty", "environment 'broken-env' has no training examples with env.args {'kind': 'empty'}"),
        pytest.param("no_prompt", "has no 'prompt' column (columns: text)", marks=pytest.mark.slow),
        ("env_response", "the environment raised RuntimeError: tool server crashed in env_response (broken_env.py:"),
    ],
)  # fmt: skip
def test_broken_environments_are_named(tmp_path, tiny_model_dir, broken_env_path, kind, message):
    cfg = _cfg(tmp_path, tiny_model_dir, steps=5, save_steps=100, extra="")
    text = (
        cfg.read_text()
        .replace('id = "reverse-text"', 'id = "broken-env"')
        .replace("num_train_examples = 32\nnum_eval_examples = 4", f'kind = "{kind}"')
    )
    text = text.replace("max_async_level = 1", "max_async_level = 1\nmax_empty_steps = 2")
    cfg.write_text(text)
    env = {"PYTHONPATH": f"{broken_env_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r, pid = run_command("vf-rl", "@", cfg, env=env, timeout=300)
    assert r.returncode == (2 if kind == "empty" else 1), r.stderr[-3000:]  # an empty one: before anything starts
    assert message in _error_line(r.stderr)
    assert not _wait_survivors_gone(pid)


def test_env_args_the_environment_does_not_take(tmp_path, tiny_model_dir, broken_env_path):
    cfg = _cfg(tmp_path, tiny_model_dir)
    cfg.write_text(
        cfg.read_text()
        .replace('id = "reverse-text"', 'id = "broken-env"')
        .replace("num_train_examples = 32\nnum_eval_examples = 4", 'kinds = "raising"')
    )
    env = {"PYTHONPATH": f"{broken_env_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r, pid = run_command("vf-rl", "@", cfg, env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    line = _error_line(r.stderr)
    assert "unknown key env.args.kinds (did you mean 'kind'?): load_environment of 'broken-env' takes kind" in line
    assert not survivors(pid)


# ---------------------------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, tiny_model_dir):
    """A run with checkpoint-2 and checkpoint-4, copied fresh for each corruption."""
    root = tmp_path_factory.mktemp("ckpt")
    cfg = _cfg(root, tiny_model_dir, steps=4, save_steps=2)
    r, pid = run_command("vf-rl", "@", cfg, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return root


def _corrupt(folder: Path, how: str) -> str:
    if how == "truncated model":
        path = folder / "adapter_model.safetensors"
        path.write_bytes(path.read_bytes()[:100])
    elif how == "corrupt trainer_state":
        path = folder / "trainer_state.json"
        path.write_text("{not json")
    elif how == "truncated orchestrator":
        path = folder / "orchestrator.pt"
        path.write_bytes(path.read_bytes()[:50])
    elif how == "missing optimizer":
        path = folder / "optimizer.pt"
        path.unlink()
    elif how == "interrupted save":
        path = folder / "vf_rl_checkpoint.json"
        path.unlink()
    return path.name


CORRUPTIONS = [
    "truncated model",
    "corrupt trainer_state",
    "truncated orchestrator",
    "missing optimizer",
    "interrupted save",
]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_every_corruption_of_a_real_checkpoint_is_named_before_resuming(tmp_path, two_checkpoints, how):
    """The check a resume runs first, on each corruption of a checkpoint a real run wrote (no run: the fallback
    itself is the next test's)."""
    import shutil

    from verifiers_rl.export.checkpoints import problem

    folder = tmp_path / "checkpoint-4"
    shutil.copytree(two_checkpoints / "out" / "checkpoint-4", folder)
    assert problem(folder, use_lora=True) is None
    name = _corrupt(folder, how)
    why = problem(folder, use_lora=True)
    assert why is not None and name in why, why


# CI runs the whole fallback for two kinds (a file the loader reads, the save's completion marker); `-m slow` the rest
@pytest.mark.parametrize(
    "how",
    [
        h if h in ("truncated model", "interrupted save") else pytest.param(h, marks=pytest.mark.slow)
        for h in CORRUPTIONS
    ],
)
def test_broken_newest_checkpoint_falls_back_to_the_previous(tmp_path, two_checkpoints, tiny_model_dir, how):
    import shutil

    shutil.copytree(two_checkpoints / "out", tmp_path / "out")
    name = _corrupt(tmp_path / "out" / "checkpoint-4", how)
    cfg = _cfg(tmp_path, tiny_model_dir, steps=5, save_steps=100)
    r, pid = run_command("vf-rl", "@", cfg, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "not resuming from checkpoint-4: " in r.stderr and name in r.stderr
    assert _steps(tmp_path / "out") == [1, 2, 3, 4, 5]  # steps 3-4 redone from checkpoint-2, each logged once


def test_checkpoint_of_the_other_lora_mode_is_named(tmp_path, two_checkpoints, tiny_model_dir):
    import shutil

    shutil.copytree(two_checkpoints / "out", tmp_path / "out")
    cfg = _cfg(tmp_path, tiny_model_dir, steps=5, save_steps=100, extra="use_lora = false\n")
    r, pid = run_command("vf-rl", "@", cfg, timeout=300)
    # the settings the checkpoint was trained with are compared first (issue 55): the LoRA mode is a change that no
    # resume can continue, named with both values before anything starts
    assert r.returncode == 2, r.stderr[-2000:]
    line = _error_line(r.stderr)
    assert "was trained with other settings: " in line and "use_lora true -> false" in line, line
    assert 'on_settings_change = "continue" cannot (' in line and "use_lora" in line.split("cannot (")[1]


# ---------------------------------------------------------------------------------------------- config types


@pytest.mark.parametrize(
    "body, args, message",
    [
        ('max_steps = "2"\n', [], "trainer.args.max_steps='2': expected int"),
        ("", ["--trainer.args.max_steps", "abc"], "trainer.args.max_steps='abc': expected int"),
        ('learning_rate = "fast"\n', [], "trainer.args.learning_rate='fast': expected float"),
        ("", ["--inference.port", "70000"], "inference.port=70000: must be a TCP port in 1..65535"),
        ("vllm_server_port = 70000\n", [], "trainer.args.vllm_server_port=70000: must be a TCP port"),
    ],
)
def test_wrong_types_name_the_key_and_are_fast(tmp_path, body, args, message):
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'model = "tiny"\n[env]\nid = "reverse-text"\n[trainer.args]\n{body}')
    t0 = time.monotonic()
    r, pid = run_command("vf-rl", "@", cfg, *args)
    assert time.monotonic() - t0 < 2.0
    assert r.returncode == 2 and message in _error_line(r.stderr)


# ---------------------------------------------------------------------------------------------- control routes


def test_control_routes_answer_bad_values_with_400(tiny_model_dir, tmp_path):
    import httpx

    from verifiers_rl.config.net import free_port
    from verifiers_rl.serving.launcher import InferenceServer

    with InferenceServer(tiny_model_dir, engine="cpu", output_dir=tmp_path) as client:
        auth = {"Authorization": f"Bearer {client.control_token}"}
        url = client.base_url
        bad = [
            ("/update_weight_version", {"new_version": "abc"}, "new_version='abc': expected a non-negative integer"),
            ("/finish_weight_update", {"weight_version": "x"}, "weight_version='x': expected a non-negative integer"),
            (
                "/init_weight_transfer_engine",
                {"init_info": {"master_address": "127.0.0.1", "master_port": free_port(), "timeout_s": 3}},
                "cannot reach the trainer's weight-sync store at 127.0.0.1:",
            ),
            ("/init_weight_transfer_engine", {"init_info": {"master_port": "x"}}, "init_info"),
            ("/update_weights", {"update_info": {"names": ["a"]}}, "update_info"),
        ]
        for path, body, message in bad:
            r = httpx.post(url + path, json=body, headers=auth, timeout=30)
            assert r.status_code == 400 and message in r.json()["message"], (path, r.status_code, r.text)
        assert httpx.get(url + "/health").status_code == 200
        assert client.weight_version() == "0"  # nothing changed
