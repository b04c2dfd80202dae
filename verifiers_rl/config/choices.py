"""The run's choices as types: each setting with a fixed set of values is one `StrEnum`, so the plan compares
members, not strings, and a value read from TOML or JSON (a plain string) converts once, where it is checked.
`StrEnum` members are strings, so what reaches a command line, a log or JSON reads as the user wrote it."""

from __future__ import annotations

from enum import StrEnum


class Engine(StrEnum):
    AUTO = "auto"  # vLLM when it is installed and a GPU is visible, else our CPU engine
    CPU = "cpu"
    VLLM = "vllm"


class CpuEngine(StrEnum):
    """The CPU engine's loop: our slot engine (Llama-family models), transformers' continuous batching, or auto
    (slots where the lean forward supports the model)."""

    AUTO = "auto"
    SLOTS = "slots"
    CB = "cb"


class SyncBackend(StrEnum):
    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"


class Transport(StrEnum):
    """How the plan moves weights (resolved from `SyncBackend` and `LoraSync`): LoRA A/B over gloo into the
    served adapter, every weight over gloo (host memory), or over NCCL (GPU to GPU, vLLM's own engine)."""

    GLOO = "gloo"
    ADAPTER = "adapter"
    NCCL = "nccl"


# vLLM's NCCL backend for sparse patches (its `sparse_nccl` weight-transfer engine): what a vLLM server runs when the
# plan syncs changes only over NCCL (sync/transport/nccl.py).
SPARSE_NCCL = "sparse_nccl"


class LoraSync(StrEnum):
    """What a LoRA run sends each sync: the merged weights, or the adapter (vLLM loads it as a LoRA)."""

    AUTO = "auto"
    MERGED = "merged"
    ADAPTER = "adapter"


class ServerMode(StrEnum):
    AUTO = "auto"  # connect to a server already listening at host:port, else start one
    SPAWN = "spawn"
    CONNECT = "connect"


def values(choice: type[StrEnum]) -> tuple[str, ...]:
    return tuple(member.value for member in choice)


ENGINES = values(Engine)
CPU_ENGINES = values(CpuEngine)
SYNC_BACKENDS = values(SyncBackend)
LORA_SYNC = values(LoraSync)
SERVER_MODES = values(ServerMode)
