"""Whole parameters on rank 0, from their shards, for a sync: only rank 0 sends to the server, so only it needs them.

The layouts' own gathers (FSDP2's `DTensor.full_tensor()`, DeepSpeed's `GatheredParameters`) move each shard to
every rank, into fresh memory each time: on gloo an all-gather costs several times a send/recv of the same bytes,
and fresh memory pays its page faults on every sync (benchmarks/results/design_measurements.md#shard-gather).
So here each rank sends its piece of each parameter straight to rank 0 (point-to-point, no copy on the sender),
into a reused buffer where the whole parameter is then a view; a group's transfers are posted at once, so the next
group travels while rank 0 sends this one. On one host, CPU ranks skip the socket: rank 0's buffers are shared
memory, and each rank copies its pieces into them (`Ring.share`; faster than point-to-point in bench_sharded).

A layout describes a parameter as `Pieces`: flattened, it is every rank's contiguous piece in rank order (FSDP2:
torch.chunk's rows on dim 0; ZeRO-3: equal flat partitions, sent up to the end of the parameter). Rank 0 lays a
group's parameters end to end in its buffer, as the sender's bucket lays them, so a bucket is broadcast from there
with no packing (`wire.in_place`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


def dim0_rows(rows: int, world: int) -> list[int]:
    """Rows each rank holds of a dim-0 sharded tensor (torch.chunk's split, as FSDP2 and DTensor's Shard(0) cut it:
    `ceil(rows / world)` each, the last ranks fewer or none)."""
    per = math.ceil(rows / world) if rows else 0
    return [max(0, min(per, rows - r * per)) for r in range(world)]


@dataclass
class Pieces:
    shape: tuple[int, ...]
    dtype: torch.dtype
    lengths: list[int]  # elements of each rank's piece, rank order; they add up to the parameter's
    local: torch.Tensor  # this rank's piece, contiguous, 1-D (empty where lengths[rank] is 0)
    group: object | None  # the process group the pieces are spread over (rank 0 of it sends); None: whole here

    @classmethod
    def whole_here(cls, t: torch.Tensor) -> Pieces:
        """A parameter whole on every rank: rank 0's copy is the one used, nothing travels."""
        return cls(tuple(t.shape), t.dtype, [t.numel()], t.detach().reshape(-1), None)


def flat_lengths(numel: int, size: int, world: int) -> list[int]:
    """Elements of each rank's flat partition of `size` elements that lie before the end of `numel` (ZeRO-3 pads
    the last partitions; the padding is not sent)."""
    return [max(0, min(size, numel - r * size)) for r in range(world)]


def _spans(sizes: list[tuple[int, torch.dtype]]) -> list[tuple[int, int]]:
    """(offset, bytes) of each (elements, dtype), end to end (a gap only where a dtype's alignment needs one)."""
    out, off = [], 0
    for n, dtype in sizes:
        off = -(-off // dtype.itemsize) * dtype.itemsize
        out.append((off, n * dtype.itemsize))
        off += n * dtype.itemsize
    return out


def carve(buf: torch.Tensor, sizes: list[tuple[int, torch.dtype]]) -> list[torch.Tensor]:
    """1-D views of `buf` (uint8), one per (elements, dtype): one dtype gives exactly the bucket's layout."""
    return [buf[off : off + n].view(dtype) for (off, n), (_, dtype) in zip(_spans(sizes), sizes)]


def carved_bytes(sizes: list[tuple[int, torch.dtype]]) -> int:
    return sum(_spans(sizes)[-1]) if sizes else 0


def place_pieces(dest: torch.Tensor, lengths: list[int], rank: int) -> torch.Tensor:
    """The slice of `dest` (1-D, `sum(lengths)` elements) where rank `rank`'s piece belongs."""
    start = sum(lengths[:rank])
    return dest[start : start + lengths[rank]]


class Ring:
    """Reused receive buffers, one per group in flight; a sync yields views of them. The stream posts group k+1
    when the sender pulls group k, and the sender (`wire.send_buckets`) may still be broadcasting buckets k-1 and
    k-2 straight from this memory: four buffers, none reused while the sender can still read it. A group larger
    than `slot_bytes` (one tensor bigger than a bucket) gets memory of its own instead of growing a buffer for good.
    Shared memory every rank maps (`share`) spares gloo's TCP loopback a copy into the kernel and one out of it,
    on the cores the server's receive also needs."""

    SLOTS = 4

    def __init__(self, slot_bytes: int):
        self.slot_bytes = slot_bytes
        self.bufs: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8) for _ in range(self.SLOTS)]
        self.shared: dict[object, bool] = {}  # process group -> its ranks map `bufs` (decided once, by all)

    def slot(self, i: int, nbytes: int) -> torch.Tensor:
        if nbytes > self.slot_bytes:
            return torch.empty(nbytes, dtype=torch.uint8)
        k = i % self.SLOTS
        if self.bufs[k].numel() < nbytes:
            self.bufs[k] = torch.empty(self.slot_bytes, dtype=torch.uint8)
        return self.bufs[k]

    def share(self, group) -> bool:
        """Whether `group`'s ranks copy into shared buffers (a collective over `group` the first time it is asked,
        the same answer on every rank; later calls are free). Off with VF_RL_SHARD_GATHER_SHM=0, across hosts,
        for a ring already shared with another group, or where /dev/shm cannot hold the buffers (a container's
        default 64 MB, for one): then pieces travel point-to-point."""
        if group not in self.shared:
            self.shared[group] = not any(self.shared.values()) and _share_slots(self, group)
        return self.shared[group]


SHM_DIR = "/dev/shm"


def _share_slots(ring: Ring, group) -> bool:
    import os
    import socket
    import tempfile

    world, me = dist.get_world_size(group), dist.get_rank(group)
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        boot = ""
    wanted = os.environ.get("VF_RL_SHARD_GATHER_SHM", "1").lower() not in ("0", "false", "no")
    hosts: list = [None] * world
    dist.all_gather_object(hosts, (socket.gethostname(), boot, wanted), group=group)
    if len(set(hosts)) != 1 or not wanted or not boot:
        return False
    paths: list = [None]
    if me == 0:
        made: list[str] = []
        try:
            for _ in range(Ring.SLOTS):
                made.append(_shm_file(ring.slot_bytes, tempfile))
            paths = [made]
        except OSError:  # no /dev/shm, or too small to reserve the buffers (those already made go)
            for p in made:
                os.unlink(p)
    try:
        dist.broadcast_object_list(paths, group=group, group_src=0)
        if paths[0] is None:
            return False
        try:
            bufs = [torch.from_file(p, shared=True, size=ring.slot_bytes, dtype=torch.uint8) for p in paths[0]]
        except RuntimeError:
            bufs = None
        ok: list = [None] * world
        dist.all_gather_object(ok, bufs is not None, group=group)
    finally:  # every rank has mapped them, given up or failed: the names go (tmpfs memory lives while mapped)
        for p in paths[0] if me == 0 and paths[0] else []:
            os.unlink(p)
    if not all(ok):
        return False
    ring.bufs = bufs
    return True


def _shm_file(nbytes: int, tempfile) -> str:
    import os

    fd, path = tempfile.mkstemp(prefix=f"vfrl-sync-{os.getpid()}-", dir=SHM_DIR)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # reserve now: touching an unreservable page of tmpfs is a SIGBUS later
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path


# tags of the shared-memory handshake: rank 0 says a buffer is free ("go"), a rank says its pieces are in ("done")
_GO, _DONE = 1 << 20, (1 << 20) + 1


class ToRankZero:
    """One group's pieces on their way to rank 0 of their process group: posted on construction (every rank, same
    order), `wait()` gives {name: whole tensor} on rank 0 (views of `ring`'s buffer for group `index`) and {}
    elsewhere. The pieces travel over one process group (those with `group=None` do not travel): point-to-point,
    or, where the ring is shared (`Ring.share`), copied by each rank into rank 0's buffer once rank 0 says it is
    free. A rank other than 0 returns from construction only when its pieces are sent or copied."""

    def __init__(self, pieces: dict[str, Pieces], ring: Ring, index: int):
        self.works, self.out = [], {}
        if not pieces:
            return
        group = next((pc.group for pc in pieces.values() if pc.group is not None), None)
        me = dist.get_rank(group) if group is not None else dist.get_rank()
        sizes = [(sum(pc.lengths), pc.dtype) for pc in pieces.values()]
        nbytes = carved_bytes(sizes)
        device = next(iter(pieces.values())).local.device
        # the ring on the CPU (fresh memory there costs page faults); an accelerator's caching allocator reuses
        # memory by itself, and fresh tensors are safe whatever a consumer (vLLM's packer) holds on to
        on_cpu = device.type == "cpu"
        shared = on_cpu and group is not None and nbytes <= ring.slot_bytes and ring.share(group)
        senders = [r for r in range(1, max(len(pc.lengths) for pc in pieces.values())) if _has_piece(pieces, r)]
        if me != 0:
            if shared and me in senders:  # wait for rank 0's word that the buffer is free, copy in, say so
                go = torch.zeros(1, dtype=torch.uint8)
                dist.recv(go, group=group, group_src=0, tag=_GO)
                for pc, dest in zip(pieces.values(), carve(ring.slot(index, nbytes), sizes)):
                    if pc.group is not None and pc.lengths[me]:
                        place_pieces(dest, pc.lengths, me).copy_(pc.local)
                self.tokens = [go]  # alive until the send completes
                self.works.append(dist.isend(go, group=group, group_dst=0, tag=_DONE))
                return
            for tag, pc in enumerate(pieces.values()):  # no copy: the piece is sent from the shard itself
                if pc.group is not None and pc.lengths[me]:
                    self.works.append(dist.isend(pc.local, group=group, group_dst=0, tag=tag))
            return
        buf = ring.slot(index, nbytes) if on_cpu else torch.empty(nbytes, dtype=torch.uint8, device=device)
        if shared:
            self.tokens = [torch.zeros(2, dtype=torch.uint8) for _ in senders]  # [go, done] per rank
            for r, token in zip(senders, self.tokens):
                self.works.append(dist.isend(token[:1], group=group, group_dst=r, tag=_GO))
                self.works.append(dist.irecv(token[1:], group=group, group_src=r, tag=_DONE))
        for tag, ((name, pc), dest) in enumerate(zip(pieces.items(), carve(buf, sizes))):
            for r, n in enumerate(pc.lengths):
                if not n:
                    continue
                part = place_pieces(dest, pc.lengths, r)
                if r == 0:
                    part.copy_(pc.local)
                elif not shared:
                    self.works.append(dist.irecv(part, group=group, group_src=r, tag=tag))
            self.out[name] = dest.view(pc.shape)

    def wait(self) -> dict[str, torch.Tensor]:
        for w in self.works:
            w.wait()
        self.works = []
        return self.out


def _has_piece(pieces: dict[str, Pieces], rank: int) -> bool:
    return any(pc.group is not None and len(pc.lengths) > rank and pc.lengths[rank] for pc in pieces.values())
