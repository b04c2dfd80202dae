"""The trainer's side of a weight sync, behind one small interface (one module per backend).

    sender = create_sender("gloo", client, bucket_bytes=64 << 20)
    sender.init()                                  # join the server's workers in one group
    stats = sender.send(named_tensors, version=7)  # start -> describe -> move bytes -> finish(version)
    sender.close()

The client wraps `send` in pause -> send -> resume; a sender never pauses or resumes generation itself. The
policy version is the caller's (the trainer's global step): senders only carry it to the server.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the client imports this module; it must not pull torch in for a type name
    import torch

NamedTensors = Iterable[tuple[str, "torch.Tensor"]]


@dataclass
class SyncStats:
    seconds: float
    bytes: int
    tensors: int
    buckets: int
    version: int


class WeightSender(Protocol):
    backend: str

    def init(self) -> None: ...

    def send(self, named_tensors: NamedTensors, version: int) -> SyncStats: ...

    def close(self, polite: bool = True) -> None: ...


def create_sender(
    backend: str,
    client,
    *,
    host: str = "127.0.0.1",
    bucket_bytes: int | None = None,
    timeout_s: float = 300.0,
) -> WeightSender:
    """`backend`: 'gloo' (merged weights over a gloo group), 'adapter' (LoRA A/B only, into the server's LoRA
    slot for the policy adapter; see transfer/adapter.py) or 'nccl' (vLLM's own packed NCCL engine; GPU only)."""
    from verifiers_rl.rl.inference.transfer.buckets import DEFAULT_BUCKET_BYTES

    bucket_bytes = bucket_bytes or DEFAULT_BUCKET_BYTES
    if backend == "gloo":
        from verifiers_rl.rl.inference.transfer.gloo import GlooSender

        return GlooSender(client, host=host, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
    if backend == "adapter":
        from verifiers_rl.rl.inference.transfer.adapter import AdapterSender

        return AdapterSender(client, host=host, bucket_bytes=bucket_bytes, timeout_s=timeout_s)
    if backend == "nccl":
        from verifiers_rl.rl.inference.transfer.nccl import NCCLSender

        return NCCLSender(client, host=host, bucket_bytes=bucket_bytes)
    raise ValueError(f"weight-sync backend={backend!r}; allowed: gloo, adapter, nccl")
