"""Moving a sync's buckets over a weight group (`WeightGroup`, formed by gloo.py): gloo broadcasts, pipelined two
buckets deep, or, where both ends share memory (shm.py), the two slots of the shared file with a one-byte
handshake each way."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from verifiers_rl.sync.buckets import Bucket, pack, unpack
from verifiers_rl.sync.stream import bucket_tensors
from verifiers_rl.sync.transport.shm import FREE, READY, SharedSlots
from verifiers_rl.sync.verify import dropped_buckets, tensor_checksum


@dataclass
class WeightGroup:
    pg: object  # ProcessGroupGloo
    store: object  # kept alive with the group: gloo reads the store lazily
    rank: int
    world_size: int
    key: str = ""  # the run's secret: every key this group puts in the store lives under it
    # Two staging buffers reused across syncs: a fresh 256 MB buffer per sync costs page faults that take
    # longer than the transfer itself (benchmarks/results/design_measurements.md#staging-buffers).
    buffers: list = field(default_factory=list)
    # Set when both ends share memory (shm.py): buckets then go through it, and the group carries the handshake.
    shm: SharedSlots | None = None

    def staging(self, nbytes: int) -> list[torch.Tensor]:
        if not self.buffers or self.buffers[0].numel() < nbytes:
            self.buffers = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(2)]
        return self.buffers


def broadcast(group: WeightGroup, tensor: torch.Tensor, root: int = 0) -> None:
    broadcast_async(group, tensor, root).wait()


def broadcast_async(group: WeightGroup, tensor: torch.Tensor, root: int = 0):
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    return group.pg.broadcast([tensor], opts)


def send_buckets(
    group: WeightGroup, buckets: list[Bucket], tensors: Iterable[tuple[str, torch.Tensor]], checksums=None
) -> int:
    """Trainer side: pack bucket i+1 while bucket i is on the wire (gloo runs collectives on its own threads),
    pulling each bucket's tensors from `tensors` (a stream in bucket order) only when it is packed; a bucket
    whose tensors already lie as the bucket lays them (one contiguous tensor; a sharded export's receive buffer)
    is sent straight from their memory, no copy (`in_place`). `checksums` (a list) receives each
    tensor's `verify.tensor_checksum` as the stream produced it (while the previous bucket is on the wire)."""
    if not buckets:
        return 0
    checked = _checked(buckets, tensors, checksums)
    if group.shm is not None:
        return _send_shared(group, checked)
    bufs = group.staging(max(b.nbytes for b in buckets))
    in_flight: list = [None, None]
    for i, (bucket, ts) in enumerate(checked):
        if in_flight[i % 2] is not None:
            in_flight[i % 2][0].wait()  # this staging buffer is free again
        payload = _payload(bucket, ts, bufs[i % 2])
        in_flight[i % 2] = (broadcast_async(group, payload), payload)  # the payload kept alive while it travels
    for item in in_flight:
        if item is not None:
            item[0].wait()
    return sum(b.nbytes for b in buckets)


def _checked(buckets: list[Bucket], tensors, checksums: list | None):
    for bucket, ts in bucket_tensors(buckets, tensors):
        if checksums is not None:
            checksums.extend(tensor_checksum(t) for t in ts)
        yield bucket, ts


def _payload(bucket: Bucket, ts: list[torch.Tensor], buf: torch.Tensor) -> torch.Tensor:
    payload = in_place(bucket, ts)
    return payload if payload is not None else pack(bucket, ts, out=buf[: bucket.nbytes])


def _send_shared(group: WeightGroup, checked) -> int:
    """`send_buckets` through shared memory (shm.py): pack bucket i into slot i % 2 once the receiver has freed
    it, then tell the receiver; it copies the bucket out while the next one is packed."""
    shm, pg = group.shm, group.pg
    freed: list = [None, None]  # per slot: the receiver's "slot free" for the bucket last packed there
    ready: list = []
    sent = n_shared = 0
    for i, (bucket, ts) in enumerate(checked):
        if not shm.fits(bucket.nbytes):  # one tensor above the bucket size: by broadcast, in its turn
            broadcast(group, _payload(bucket, ts, group.staging(bucket.nbytes)[0]))
        else:
            slot, n_shared = n_shared % 2, n_shared + 1
            if freed[slot] is not None:
                freed[slot].wait()
            pack(bucket, ts, out=shm.slot(slot, bucket.nbytes))
            ready.append(shm.send(pg, 1, i, READY))
            freed[slot] = shm.recv(pg, 1, i, FREE)
        sent += bucket.nbytes
    for work in ready + [w for w in freed if w is not None]:
        work.wait()
    return sent


def _receive_shared(group: WeightGroup, buckets: list[Bucket], on_bucket, place, dropped: set[int]) -> None:
    """`receive_buckets` through shared memory: copy bucket i out of its slot (each tensor into its place, or
    through `on_bucket`), then free the slot for the trainer."""
    shm, pg = group.shm, group.pg
    freed: list = []
    n_shared = 0
    for i, bucket in enumerate(buckets):
        keep = i not in dropped
        dest = place(bucket) if place is not None and keep else None
        one = end_to_end(bucket, dest)  # places end to end: one copy (or one broadcast) for the whole bucket
        if not shm.fits(bucket.nbytes):
            view = one if one is not None else group.staging(bucket.nbytes)[0][: bucket.nbytes]
            broadcast(group, view)
            if one is None:
                _land(bucket, view, dest, keep, on_bucket)
            continue
        slot, n_shared = n_shared % 2, n_shared + 1
        shm.recv(pg, 0, i, READY).wait()
        view = shm.slot(slot, bucket.nbytes)
        if one is not None:
            one.copy_(view)
        else:
            _land(bucket, view, dest, keep, on_bucket)
        freed.append(shm.send(pg, 0, i, FREE))
    for work in freed:
        work.wait()


def _land(bucket: Bucket, buf: torch.Tensor, dest: list[torch.Tensor] | None, keep: bool, on_bucket) -> None:
    """A bucket received into `buf` (staging or a shared-memory slot) to where it goes: each tensor to its place,
    else through `on_bucket`; nowhere for a dropped bucket."""
    if dest is not None:
        scatter(bucket, buf, dest)
    elif keep:
        on_bucket(unpack(bucket, buf))


def scatter(bucket: Bucket, buf: torch.Tensor, dest: list[torch.Tensor]) -> None:
    """Copy each tensor's bytes out of a received bucket into its place."""
    for meta, off, d in zip(bucket.metas, bucket.offsets, dest):
        d.copy_(buf[off : off + meta.nbytes])


def end_to_end(bucket: Bucket, dest: list[torch.Tensor] | None) -> torch.Tensor | None:
    """The places of a bucket's tensors (uint8 views) as one uint8 tensor, when `in_place` finds them end to end
    at the bucket's offsets (a bucket can then be received straight there); None otherwise."""
    return in_place(bucket, [d.view(m.dtype) for d, m in zip(dest, bucket.metas)]) if dest else None


def in_place(bucket: Bucket, ts: list[torch.Tensor]) -> torch.Tensor | None:
    """The bucket's bytes where they already are, when its tensors lie end to end in one storage at the bucket's
    offsets; None otherwise (the bucket is packed)."""
    first = ts[0]
    storage = first.untyped_storage()
    start = first.data_ptr()
    for t, meta, off in zip(ts, bucket.metas, bucket.offsets):
        same = t.untyped_storage().data_ptr() == storage.data_ptr() and t.data_ptr() == start + off
        if t.dtype != meta.dtype or not t.is_contiguous() or not same:
            return None
    begin = start - storage.data_ptr()
    if not bucket.nbytes or begin + bucket.nbytes > storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, begin, (bucket.nbytes,))


def receive_buckets(group: WeightGroup, buckets: list[Bucket], on_bucket, place=None) -> None:
    """Receiver side: bucket i+1 arrives into one staging buffer while `on_bucket` copies bucket i out of the
    other. `on_bucket` gets [(name, view into the staging buffer)] and must copy what it keeps.

    `place(bucket)` may return where each of a bucket's tensors belongs (uint8 views of the destination itself,
    e.g. the engine's parameters): such a bucket lands there and `on_bucket` is not called for it. Where those
    places lie end to end as the bucket lays them out, the bucket is received straight into them, no copy;
    otherwise it is staged and each tensor copied to its place."""
    if not buckets:
        return
    bufs: list[torch.Tensor] = []
    dropped = dropped_buckets(len(buckets), group.rank)  # empty unless a test breaks this receiver on purpose
    if group.shm is not None:
        return _receive_shared(group, buckets, on_bucket, place, dropped)

    def post(i: int):
        dest = place(buckets[i]) if place is not None and i not in dropped else None
        one = end_to_end(buckets[i], dest)
        if one is not None:
            return broadcast_async(group, one), None, None
        if not bufs:
            bufs.extend(group.staging(max(b.nbytes for b in buckets)))
        staged = bufs[i % 2][: buckets[i].nbytes]
        return broadcast_async(group, staged), staged, dest

    pending = post(0)
    for i, bucket in enumerate(buckets):
        work, staged, dest = pending
        work.wait()
        if i + 1 < len(buckets):
            pending = post(i + 1)
        if staged is not None:
            _land(bucket, staged, dest, i not in dropped, on_bucket)
