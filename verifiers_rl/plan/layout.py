"""How a server is started: the `vf-vllm` command of a `ServerSpec`, the adapter-serving flags, and flag
helpers that read a user's vLLM flags the way vLLM does.

What to start (engine, backend, memory split) is decided by the serving plan (`verifiers_rl.plan.serving`);
this module only turns those decisions into a command line.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from verifiers_rl.config.choices import Engine
from verifiers_rl.config.net import LOOPBACK

SERVER_MODULE = "verifiers_rl.inference.server"
# Adapter sync (lora_sync="adapter") into vLLM: the served adapter's name and the worker extension that installs it.
ADAPTER_NAME = "policy"
# the worker extension vf-vllm starts vLLM with (adapter sync, and the workers' GPUs for the plan)
WORKER_EXTENSION = "verifiers_rl.inference.vllm.extension.WorkerExtension"
LORA_EXTENSION = WORKER_EXTENSION
# the extension's method that names each worker's GPU (`POST /collective_rpc`), asked before the trainer plans
DEVICE_RPC = "vf_device_uuids"
# the launcher's pid, in the server's environment: a server whose parent died exits instead of lingering
PARENT_ENV = "VF_PARENT_PID"
# vLLM accepts only these --max-lora-rank values.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


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


def flag_value(args: Sequence[str], name: str) -> str | None:
    """The value of `--name V` / `--name=V` in `args` (the last one wins, as in argparse); None when absent."""
    value = None
    for i, arg in enumerate(args):
        if flag_name(arg) == name:
            if "=" in arg:
                value = arg.split("=", 1)[1]
            elif i + 1 < len(args):
                value = args[i + 1]
    return value


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
    host: str = LOOPBACK
    port: int | None = None
    gpus: list[int] | None = None  # CUDA_VISIBLE_DEVICES of the server
    max_model_len: int | None = None
    data_parallel_size: int = 1
    extra_args: list[str] = field(default_factory=list)  # user flags, passed through (vLLM flags for vLLM)
    adapter: AdapterServing | None = None  # vLLM serves the policy as this LoRA adapter (adapter sync)
    weight_backend: str | None = None  # vLLM's --weight-transfer-backend (the plan's; None: vf-vllm's default)

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
        if self.engine == Engine.CPU and not has_flag(self.extra_args, "disable-uvicorn-access-log"):
            # a line per rollout request, written by the thread that also answers them: 9 % of that thread's
            # samples at 64 requests in flight (py-spy), on the cores generation shares with training
            argv.append("--disable-uvicorn-access-log")
        if self.engine == Engine.VLLM:  # the CPU engine takes every sync as it is
            backend = self.weight_backend or ("gloo" if self.adapter is not None else None)
            user_set = any(has_flag(self.extra_args, f) for f in ("weight-transfer-backend", "weight-transfer-config"))
            if backend and not user_set:  # the trainer's sender and the server's receiver must be one backend
                argv += ["--weight-transfer-backend", backend]
            if self.adapter is not None:
                argv += self.adapter.vllm_args(self.extra_args)
        return argv + self.extra_args
