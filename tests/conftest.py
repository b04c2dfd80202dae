"""Shared fixtures. The whole suite runs offline: hub access is disabled and non-loopback sockets refused."""

from __future__ import annotations

import ipaddress
import os
import socket

import pytest
from ports import default_port_shared

# Set before anything imports huggingface_hub / transformers / wandb; inherited by child processes.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_real_connect = socket.socket.connect


def _loopback_only_connect(self, address):
    # A test that reaches the network is a bug here: CI and users' laptops may have none.
    if self.family in (socket.AF_INET, socket.AF_INET6):
        host = address[0]
        try:
            ok = ipaddress.ip_address(host).is_loopback
        except ValueError:
            ok = host == "localhost"
        if not ok:
            raise OSError(f"test tried to reach the network ({host}); the suite must run offline")
    return _real_connect(self, address)


socket.socket.connect = _loopback_only_connect


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir, tmp_path_factory):
    """The plain real-vLLM server of tests/servers.py, shared by test_engine_robustness and test_protocol: a start is
    ~50 s of the conformance run, and neither module restarts or reconfigures it (their other servers are ours).
    Session scope is per pytest-xdist worker: with the two modules on different workers, each starts one."""
    from servers import start_server

    srv = start_server("vllm", tiny_model_dir, tmp_path_factory.mktemp("srv-vllm"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny model + tokenizer on disk, built once per session."""
    from verifiers_rl.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="session")
def qwen_model_dir(tmp_path_factory):
    """The tiny Qwen kit on disk (Qwen's BPE, Qwen3's added tokens and rows, the Qwen3-style template), built once
    per session: converting the ranks and writing 151,936 embedding rows takes seconds."""
    from verifiers_rl.tiny.qwen import save_qwen_model

    return str(save_qwen_model(tmp_path_factory.mktemp("tiny-qwen") / "model"))


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The kit's tokenizer, built once per session without a model (tests only read it)."""
    from verifiers_rl.tiny.qwen import build_qwen_tokenizer

    return build_qwen_tokenizer()


@pytest.fixture(params=["bytes", "qwen"])
def kit_model_dir(request):
    """Each tiny kit's model folder in turn: the byte-level one and the Qwen one."""
    return request.getfixturevalue("tiny_model_dir" if request.param == "bytes" else "qwen_model_dir")


@pytest.fixture(autouse=True)
def _default_port_shared(request):
    """Every test but the user's-own-server ones shares port 8000's lock (tests/ports.py)."""
    if {"user_server", "port_8000"} & set(request.fixturenames):  # they take the exclusive lock themselves
        yield
        return
    with default_port_shared():
        yield
