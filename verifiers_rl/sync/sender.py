"""The trainer's side of a weight sync, behind one small interface (one module per backend, sync/backends.py).

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
