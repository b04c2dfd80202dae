"""Every request of a weight sync runs under the sync's deadline, not the client's per-request one: a server that
takes longer than a control request may (a large model loading, a slow adapter install) is still a good sync.

Our CPU server in this process (uvicorn in a thread, so its engine can be slowed down through its own methods);
the NCCL sender's requests are checked the same way in test_nccl_sync.py.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import pytest
from peft_models import lora_model
from waits import wait_until

from verifiers_rl.serving.client import InferenceClient
from verifiers_rl.sync.policy_weights import adapter_weights, merged_stream

REQUEST_TIMEOUT_S, DELAY_S = 0.5, 1.5


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    import uvicorn

    from verifiers_rl.inference.cpu.app import create_app
    from verifiers_rl.inference.cpu.engines import load_engine

    engine = load_engine(tiny_model_dir, max_model_len=128, max_num_seqs=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine, "tiny"), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    # a server that failed to bind ends its thread: say so at once instead of hanging until pytest's timeout
    wait_until(lambda: server.started or not thread.is_alive(), 180, "uvicorn in its thread starting")
    assert server.started, "uvicorn's thread ended before it started serving"
    yield engine, port
    server.should_exit = True
    thread.join(10)


def _slow(monkeypatch, engine, method: str) -> None:
    """The engine's own `method`, DELAY_S slower: the server answers that sync request late."""
    original = getattr(engine, method)

    def slowed(*args, **kwargs):
        time.sleep(DELAY_S)
        return original(*args, **kwargs)

    monkeypatch.setattr(engine, method, slowed)


@contextlib.contextmanager
def _client(port: int):
    client = InferenceClient(port=port, request_timeout=REQUEST_TIMEOUT_S, sync_timeout=60.0)
    try:
        yield client
    finally:
        client.close()


def test_the_slow_server_is_too_slow_for_a_plain_control_request(served, monkeypatch):
    engine, port = served
    _slow(monkeypatch, engine, "finish_update")
    with _client(port) as client, pytest.raises(httpx.ReadTimeout):
        client.post("/finish_weight_update", {"weight_version": "0"})


# before the merged syncs: the CPU engine takes no adapter sync after a merged one (its pristine base is gone)
def test_adapter_sync_waits_for_a_slow_install(served, monkeypatch):
    engine, port = served
    peft = lora_model(seed=1).eval()
    with _client(port) as client:
        client.init_weight_transfer("adapter", bucket_bytes=64 * 1024)
        _slow(monkeypatch, engine, "load_weights")
        stats = client.update_weights(adapter_weights(peft), version=4)
        assert stats.version == 4 and client.weight_version() == "4"


@pytest.mark.parametrize("method", ["finish_update", "reset_prefix_cache"])
def test_merged_sync_waits_for_a_slow_server(served, monkeypatch, method):
    engine, port = served
    peft = lora_model(seed=0).eval()
    with _client(port) as client:
        client.init_weight_transfer("gloo", bucket_bytes=64 * 1024)
        _slow(monkeypatch, engine, method)
        t0 = time.monotonic()
        stats = client.update_weights(merged_stream(peft), version=3)
        assert time.monotonic() - t0 >= DELAY_S
        assert stats.version == 3 and client.weight_version() == "3"
