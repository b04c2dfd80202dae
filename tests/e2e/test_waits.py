"""Waits that explain themselves and stop: `vf-train` pointed at something that is not an inference server says
so within seconds, naming what answered and where; SIGTERM ends a wait for a server that never answers."""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import threading
import time

import pytest
from procs import BIN, survivors

pytestmark = pytest.mark.faults


def _config(tmp_path, model: str, port: int):
    path = tmp_path / "cfg.toml"
    path.write_text(
        f'model = "{model}"\noutput_dir = "{tmp_path / "out"}"\n[env]\nid = "reverse-text"\n[inference]\n'
        f"port = {port}\n[trainer.args]\nbatch_size = 8\nrollouts_per_example = 4\nmax_steps = 1\n"
    )
    return path


def test_a_plain_http_server_is_named_not_awaited(tmp_path, tiny_model_dir):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        t0 = time.monotonic()
        r = subprocess.run([BIN / "vf-train", "@", _config(tmp_path, tiny_model_dir, port)], capture_output=True,
                           text=True, timeout=120)  # fmt: skip
        took = time.monotonic() - t0
    finally:
        server.shutdown()
    assert r.returncode == 1, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert f"http://127.0.0.1:{port} is not an inference server: GET /health answered 404 from SimpleHTTP" in line
    assert took < 60  # start-up plus the 5 s it gives a listener to become a server, not the 600 s start timeout


def test_sigterm_ends_the_wait_for_a_server(tmp_path, tiny_model_dir):
    listener = socket.create_server(("127.0.0.1", 0))  # accepts, never answers: a server that hangs
    port = listener.getsockname()[1]
    accepted = []

    def accept():
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    proc = subprocess.Popen([BIN / "vf-train", "@", _config(tmp_path, tiny_model_dir, port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    stopped_at = []

    def read_stderr():
        for line in proc.stderr:
            if "verifiers-rl: stopped by SIGTERM" in line:  # the line that says where the run stands
                stopped_at.append(time.monotonic())

    threading.Thread(target=read_stderr, daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while not accepted and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # the trainer reached the wait: its first /health request is in
        assert accepted, "vf-train never asked the server for /health"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        # the wait ends at once (the interpreter's own shutdown after it is torch's, and slower on a busy machine)
        assert stopped_at and stopped_at[0] - t0 < 5, f"the wait ended {stopped_at and stopped_at[0] - t0} s after"
        assert proc.returncode == 128 + signal.SIGTERM
        assert not survivors(proc.pid)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        listener.close()
        for conn in accepted:
            conn.close()
