"""Endpoints for `vf-eval -m <name>`: evaluate against the server `vf-rl` / `vf-vllm` starts locally.

Start one with `vf-vllm --model <model> --port 8000` (GPU: vLLM; CPU: `--engine cpu`).
"""

ENDPOINTS = {
    "local": {"model": "local", "url": "http://127.0.0.1:8000/v1", "key": "EMPTY"},
    "qwen3-0.6b": {"model": "Qwen/Qwen3-0.6B", "url": "http://127.0.0.1:8000/v1", "key": "EMPTY"},
    "qwen3-4b-instruct": {"model": "Qwen/Qwen3-4B-Instruct-2507", "url": "http://127.0.0.1:8000/v1", "key": "EMPTY"},
}
