"""Which engine serves, which weight-sync backend follows from it, and the flags a server is started with.

One owner for these rules: `RLConfig`, `vf-rl`'s plan, the launcher, `vf-vllm` and the trainer's runtime all
ask this module, so the engine a server was started with and the backend the trainer syncs with can never
disagree (a CUDA host without vLLM gets the CPU engine *and* gloo, not the CPU engine and an NCCL sender).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

ENGINES = ("auto", "cpu", "vllm")
# The CPU engine's loop: our slot engine (Llama-family models), transformers' continuous batching, or auto
# (slots where the lean forward supports the model; engines.create_engine decides and logs why).
CPU_ENGINES = ("auto", "slots", "cb")
SYNC_BACKENDS = ("auto", "gloo", "nccl")
SERVER_MODULE = "verifiers_rl.rl.inference.server"
# Adapter sync (lora_sync="adapter") into vLLM: the served adapter's name and the worker extension that installs it.
ADAPTER_NAME = "policy"
LORA_EXTENSION = "verifiers_rl.rl.inference.vllm_lora.LoraSyncExtension"
# vLLM accepts only these --max-lora-rank values.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken CUDA setup is no CUDA here
        return False


def resolve_engine(requested: str, *, cuda: bool | None = None, vllm: bool | None = None) -> str:
    """'auto' -> 'vllm' when CUDA and vLLM are both present, else 'cpu'; 'cpu'/'vllm' stay as asked."""
    if requested not in ENGINES:
        raise ValueError(f"engine={requested!r}; allowed: {', '.join(ENGINES)}")
    if requested != "auto":
        return requested
    cuda = cuda_available() if cuda is None else cuda
    vllm = vllm_installed() if vllm is None else vllm
    return "vllm" if cuda and vllm else "cpu"


def resolve_sync_backend(requested: str, engine: str, shared_gpu: bool = False) -> str:
    """The weight-sync backend for a server running `engine` (already resolved).

    The CPU engine only speaks gloo. vLLM defaults to NCCL (GPU to GPU); gloo reaches it through our plugin
    (the vLLM CPU build, or a trainer without a GPU of its own).
    """
    if requested not in SYNC_BACKENDS:
        raise ValueError(f"sync_backend={requested!r}; allowed: {', '.join(SYNC_BACKENDS)}")
    if engine not in ("cpu", "vllm"):
        raise ValueError(f"engine={engine!r} is not resolved; call resolve_engine first")
    if engine == "cpu":
        if requested == "nccl":
            raise ValueError("sync_backend='nccl' needs a vLLM server; the CPU engine syncs over gloo")
        return "gloo"
    if shared_gpu:
        if requested == "nccl":
            raise ValueError("sync_backend='nccl' cannot sync a server on the trainer's own GPU; use gloo")
        return "gloo"
    return "nccl" if requested == "auto" else requested


def engine_of_models(models: list[dict]) -> str:
    """The engine behind a running server, from its /v1/models answer (our CPU server says it owns the model)."""
    return "cpu" if models and models[0].get("owned_by") == "verifiers-rl" else "vllm"


def flag_name(arg: str) -> str | None:
    """`--Max_Model-Len=5` -> `max-model-len`; None for values and positionals.

    vLLM's parser treats `_` and `-` in flag names alike, so a user's spelling must match ours either way."""
    if not arg.startswith("--") or arg == "--":
        return None
    return arg[2:].split("=", 1)[0].replace("_", "-").lower()


def has_flag(args: Sequence[str], name: str) -> bool:
    return any(flag_name(a) == name for a in args)


@dataclass(frozen=True)
class AdapterServing:
    """The policy served as a LoRA adapter (adapter sync): requests name `name`; `path` holds the step-0 adapter
    (`transfer.adapter.adapter_serving` writes it) that vLLM registers at startup; `rank` is its largest rank."""

    name: str
    path: str
    rank: int

    def vllm_args(self, user_args: Sequence[str] = ()) -> list[str]:
        """vLLM flags for adapter sync; a flag the user already gives (`user_args`) is left to the user."""
        fits = [r for r in VLLM_LORA_RANKS if r >= self.rank]
        if not fits:
            raise ValueError(f"LoRA rank {self.rank} is above vLLM's largest --max-lora-rank {VLLM_LORA_RANKS[-1]}")
        ours = [
            ("enable-lora", []),
            ("max-lora-rank", [str(fits[0])]),
            # one adapter, pinned in its slot: nothing else may evict it and make vLLM re-read the step-0 files
            ("max-loras", ["1"]),
            ("lora-modules", [f"{self.name}={self.path}"]),
            ("worker-extension-cls", [LORA_EXTENSION]),
        ]
        return [arg for flag, value in ours if not has_flag(user_args, flag) for arg in (f"--{flag}", *value)]


@dataclass
class ServerSpec:
    """Everything that decides how an inference server is started; `argv()` is the `vf-vllm` command."""

    model: str
    engine: str  # resolved: "cpu" | "vllm"
    host: str = "127.0.0.1"
    port: int | None = None
    gpus: list[int] | None = None  # CUDA_VISIBLE_DEVICES of the server
    max_model_len: int | None = None
    data_parallel_size: int = 1
    extra_args: list[str] = field(default_factory=list)  # user flags, passed through (vLLM flags for vLLM)
    adapter: AdapterServing | None = None  # vLLM serves the policy as this LoRA adapter (adapter sync)

    def __post_init__(self):
        if self.engine not in ("cpu", "vllm"):
            raise ValueError(f"ServerSpec.engine={self.engine!r}; resolve 'auto' with resolve_engine first")
        self.extra_args = [str(a) for a in self.extra_args]

    def argv(self, python: str = sys.executable) -> list[str]:
        port = "<free port>" if self.port is None else str(self.port)
        argv = [
            python,
            "-m",
            SERVER_MODULE,
            "--engine",
            self.engine,
            "--model",
            self.model,
            "--host",
            self.host,
            "--port",
            port,
        ]
        # the user's own flag wins over what the trainer derives (max_seq_len, [inference] gpus)
        if self.max_model_len and not has_flag(self.extra_args, "max-model-len"):
            argv += ["--max-model-len", str(self.max_model_len)]
        if self.data_parallel_size > 1 and not has_flag(self.extra_args, "data-parallel-size"):
            argv += ["--data-parallel-size", str(self.data_parallel_size)]
        if self.adapter is not None and self.engine == "vllm":  # the CPU engine takes adapter syncs as it is
            # adapter sync moves its tensors over our gloo group, on GPU hosts too (vf-vllm's default is NCCL)
            if not any(has_flag(self.extra_args, f) for f in ("weight-transfer-backend", "weight-transfer-config")):
                argv += ["--weight-transfer-backend", "gloo"]
            argv += self.adapter.vllm_args(self.extra_args)
        return argv + self.extra_args
