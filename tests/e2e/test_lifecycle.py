"""The server lives and dies with its owner: kill -9, port clashes, bad paths, crashes at start."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from verifiers_rl.serving.client import ServerError
from verifiers_rl.serving.launcher import InferenceServer


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); treat it as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _group_alive(pgid: int) -> bool:
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_kill_9_of_parent_takes_server_down(tiny_model_dir, tmp_path):
    script = textwrap.dedent(
        f"""
        import sys, time
        from verifiers_rl.serving.launcher import InferenceServer
        srv = InferenceServer({tiny_model_dir!r}, engine="cpu", output_dir={str(tmp_path)!r})
        srv.start()
        print(srv.process.pid, srv.port, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline()
        assert line, "parent did not start the server"
        server_pid, port = map(int, line.split())
        assert _alive(server_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert _wait_gone(server_pid, 10), "server outlived its killed parent"
        # nothing of its process group (the server's own children included) survives either
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _group_alive(server_pid):
            time.sleep(0.1)
        assert not _group_alive(server_pid)
    finally:
        if parent.poll() is None:
            parent.kill()


def test_stop_on_exception_inside_context(tiny_model_dir, tmp_path):
    srv = InferenceServer(tiny_model_dir, engine="cpu", output_dir=tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        with srv:
            pid = srv.process.pid
            raise RuntimeError("boom")
    assert _wait_gone(pid, 10)
    assert (tmp_path / "logs" / "inference.log").stat().st_size > 0


def test_port_in_use_is_one_clear_error(tiny_model_dir, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServerError, match=f"port {port} on 127.0.0.1 is already in use"):
            InferenceServer(tiny_model_dir, engine="cpu", port=port, output_dir=tmp_path).start()


def test_bad_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        InferenceServer(str(tmp_path / "missing"), engine="cpu", output_dir=tmp_path).start()


def test_crash_during_start_reports_log_tail(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    srv = InferenceServer(str(broken), engine="cpu", output_dir=tmp_path, startup_timeout=60)
    with pytest.raises(ServerError) as err:
        srv.start()
    msg = str(err.value)
    assert "exited with code" in msg and "inference.log" in msg
    assert srv.process is None


def _vf_vllm(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "verifiers_rl.inference.server", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_a_server_that_cannot_be_spawned_leaves_no_client_or_process(tiny_model_dir, tmp_path):
    """start() sets the client before the process (a supervisor that sees the new pid finds its client); when
    the spawn itself fails, neither is left behind and the OS error reaches the caller."""
    server = InferenceServer(tiny_model_dir, engine="cpu", output_dir=tmp_path)
    server.command = lambda: [str(tmp_path / "no-such-binary")]
    with pytest.raises(FileNotFoundError):
        server.start()
    assert server.client is None and server.process is None


def test_vf_vllm_help_without_vllm():
    r = _vf_vllm("--help")
    assert r.returncode == 0
    assert "--engine" in r.stdout and "passed through to vLLM" in r.stdout


def test_vf_vllm_engine_vllm_without_vllm_says_what_to_install(tiny_model_dir):
    r = _vf_vllm("--engine", "vllm", "--model", tiny_model_dir)
    assert r.returncode == 2
    assert "vLLM is not installed" in r.stderr and "verifiers-rl[vllm]" in r.stderr
    assert "Traceback" not in r.stderr


def test_vf_vllm_console_script_is_installed():
    exe = os.path.join(os.path.dirname(sys.executable), "vf-vllm")
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "vf-vllm" in r.stdout


@pytest.mark.vllm
@pytest.mark.skipif(not os.environ.get("VF_VLLM_PYTHON"), reason="set VF_VLLM_PYTHON to the vLLM CPU venv's python")
def test_real_vllm_stops_at_once_and_exits_cleanly(tiny_model_dir, tmp_path):
    """`stop()` (every run's end) takes vf-vllm and vLLM down in seconds, and vLLM exits on its own. vf-vllm used to
    wait for vLLM inside its SIGTERM handler while the main thread's `Popen.wait()` held the wait lock: the nested
    wait spun for its 10 s timeout, then SIGKILLed the group, vLLM having exited cleanly in 0.5 s."""
    from servers import start_server

    srv = start_server("vllm", tiny_model_dir, tmp_path)
    wrapper = srv.process
    t0 = time.monotonic()
    srv.stop()
    elapsed = time.monotonic() - t0
    log = (tmp_path / "logs" / "inference.log").read_text()
    assert wrapper.returncode == 0 and elapsed < 5, (wrapper.returncode, elapsed, log[-2000:])
    assert "Application shutdown complete" in log  # vLLM's own orderly shutdown ran
