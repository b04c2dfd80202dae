"""A two-party gloo group for weight sync that never touches torch.distributed's default group.

The trainer owns the rendezvous (TCPStore master) so a restarted server can always rejoin it, and so the
trainer's own DDP group (if any) stays untouched. Methods are called on the ProcessGroup object itself:
`dist.broadcast(group=pg)` rejects a group that was not created through init_process_group.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verifiers_rl.rl.inference.transfer.buckets import Bucket, pack, plan_buckets, unpack

_PREFIX = "verifiers_rl_weights"


@dataclass
class WeightGroup:
    pg: object  # ProcessGroupGloo
    store: object  # kept alive with the group: gloo reads the store lazily
    rank: int
    world_size: int


def create_group(host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0) -> WeightGroup:
    """Rank 0 (the trainer) hosts the store; other ranks connect to it. Blocks until all ranks joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        host, port, world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=False
    )
    pg = dist.ProcessGroupGloo(dist.PrefixStore(_PREFIX, store), rank, world_size, timeout)
    return WeightGroup(pg, store, rank, world_size)


def broadcast(group: WeightGroup, tensor: torch.Tensor, root: int = 0) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    group.pg.broadcast([tensor], opts).wait()


def send_buckets(pg: WeightGroup, buckets: list[Bucket], tensors_by_name: dict[str, torch.Tensor]) -> int:
    """Trainer side: pack and broadcast each bucket; returns bytes sent."""
    sent = 0
    for bucket in buckets:
        buf = pack(bucket, [tensors_by_name[m.name] for m in bucket.metas])
        broadcast(pg, buf)
        sent += bucket.nbytes
    return sent


def receive_buckets(pg: WeightGroup, buckets: list[Bucket], on_bucket) -> None:
    """Receiver side: for each bucket, receive it and hand `on_bucket` its [(name, tensor view)] list."""
    buf = torch.empty(max((b.nbytes for b in buckets), default=0), dtype=torch.uint8)
    for bucket in buckets:
        view = buf[: bucket.nbytes]
        broadcast(pg, view)
        on_bucket(unpack(bucket, view))


__all__ = ["WeightGroup", "create_group", "broadcast", "send_buckets", "receive_buckets", "plan_buckets"]
