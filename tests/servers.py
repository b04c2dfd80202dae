"""Server fixtures shared by the conformance suite: our CPU engine, and real vLLM when VF_VLLM_PYTHON is set."""

from __future__ import annotations

import os

import pytest

from verifiers_rl.serving.launcher import InferenceServer

VLLM_PYTHON = os.environ.get("VF_VLLM_PYTHON", "")
# A module or test that needs the vLLM CPU venv (its python runs the vLLM side).
NEEDS_VLLM = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not (VLLM_PYTHON and os.access(VLLM_PYTHON, os.X_OK)),
        reason="set VF_VLLM_PYTHON to the python of a venv with vLLM >= 0.32",
    ),
]
ENGINES = [
    "cpu",
    pytest.param(
        "vllm",
        marks=[
            pytest.mark.vllm,
            pytest.mark.skipif(not VLLM_PYTHON, reason="set VF_VLLM_PYTHON to the vLLM CPU venv's python"),
        ],
    ),
]


def start_server(engine: str, model_dir: str, output_dir) -> InferenceServer:
    if engine == "cpu":
        server = InferenceServer(model_dir, engine="cpu", output_dir=output_dir, extra_args=["--max-model-len", "1024"])
    else:
        server = InferenceServer(
            model_dir,
            engine="vllm",
            output_dir=output_dir,
            python=VLLM_PYTHON,
            extra_args=[
                "--weight-transfer-backend",
                "gloo",
                "--max-model-len",
                "1024",
                "--dtype",
                "float32",
                "--enforce-eager",
                "--max-num-seqs",
                "32",
            ],
            env={"VLLM_CPU_KVCACHE_SPACE": "1"},
            startup_timeout=240,
        )
    server.start()
    return server
