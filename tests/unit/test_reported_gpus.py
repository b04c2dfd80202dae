"""Issue 54 item 8: a connected vLLM server with several data-parallel engines reports the GPUs of its first engine
only; the trainer counts the workers it did not hear from and does not plan NCCL onto a GPU that may be theirs.

The server here answers vLLM's two routes as vLLM 0.32 does for 2 engines x 2 workers (read in its source:
`DPAsyncMPClient.call_utility_async` keeps the first engine's result; `/get_world_size` counts TP x PP x DP; the
real server's answer is checked in tests/e2e/test_vllm_gloo.py). The trainer's GPU is faked; the client is real.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from verifiers_rl.errors import ConfigError
from verifiers_rl.plan.serving import ReportedGpus, unseen_problem
from verifiers_rl.serving.client import InferenceClient
from verifiers_rl.serving.session import ServerSession, reported_gpus
from verifiers_rl.trainer import RLConfig


@pytest.fixture
def dp_server():
    """Two data-parallel engines of two workers each, on GPUs G0 G1 (engine 0) and G2 G3 (engine 1)."""

    class Handler(BaseHTTPRequestHandler):
        def _send(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):  # /collective_rpc: the first engine's workers only
            self.rfile.read(int(self.headers["Content-Length"]))
            self._send({"results": ["G0", "G1"]})

        def do_GET(self):  # /get_world_size: TP x PP x DP
            self._send({"world_size": 4})

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield InferenceClient("127.0.0.1", server.server_address[1])
    server.shutdown()
    server.server_close()


def _on_gpu(monkeypatch, uuid: str):
    """The trainer's process sees one GPU, `uuid` (the device is what is faked)."""

    class Props:
        pass

    Props.uuid = uuid
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())


def _plan(client, tmp_path, **kw):
    args = RLConfig(output_dir=str(tmp_path), use_cpu=True, vllm_server_host="127.0.0.1", **kw)
    return ServerSession(args, None)._connected_plan("vllm", client)


def test_the_trainer_hears_of_the_workers_it_did_not_see(dp_server):
    assert reported_gpus(dp_server) == ReportedGpus(("G0", "G1"), unseen=2)


def test_nccl_is_not_planned_onto_a_gpu_another_engine_may_use(dp_server, tmp_path, monkeypatch):
    _on_gpu(monkeypatch, "G3")  # engine 1's GPU, which the server did not report
    with pytest.raises(ConfigError) as refused:
        _plan(dp_server, tmp_path)
    line = str(refused.value)
    assert "runs 4 workers but reported the GPUs of 2" in line and "G3" in line and "\n" not in line
    assert 'set sync_backend = "nccl" to say so' in line
    # the user's word that the GPUs differ: NCCL as set
    assert _plan(dp_server, tmp_path, sync_backend="nccl").sync_backend == "nccl"
    # on a GPU the server did report: shared, so no NCCL (as before: LoRA's adapter over gloo)
    _on_gpu(monkeypatch, "G0")
    shared = _plan(dp_server, tmp_path)
    assert shared.shared_gpu and shared.sync_backend == "adapter"


def test_a_complete_report_or_a_remote_server_plans_nccl():
    args = RLConfig(output_dir="/tmp/unused", use_cpu=True)
    assert unseen_problem(args, 0, ("G0", "G1"), ("G3",), local=True) is None  # every worker answered
    assert unseen_problem(args, 2, ("G0", "G1"), ("G3",), local=False) is None  # another machine's GPUs
    assert unseen_problem(args, 2, ("G0", "G1"), ("G3",), local=True) is not None
