"""Shared-memory buckets for a receiver on the trainer's own machine (our CPU engine): the bytes skip the socket.

Over loopback gloo a bucket is copied four times: packed, into the kernel's socket buffers, out of them, and out of
the staging buffer (benchmarks/results/design_measurements.md#shared-memory-buckets). Through two slots of shared
memory it is copied twice, on different cores at the same time: the trainer packs bucket i+1 while the server
copies bucket i out. The same bucket plan, checksums, reports and gloo group; the group carries the handshake, one
byte per bucket each way: "bucket i is in slot i % 2" and "slot free". A bucket larger than a slot travels by gloo
broadcast, in its turn.

Offered only where it can work: the trainer creates the file in /dev/shm and sends its path with a nonce in
`init_info`; the receiver maps it only if it finds that nonce there (another container or host sees another
/dev/shm) and says so in its answer. The trainer unlinks the file once the receiver answered: the two mappings keep
the memory, and nothing is left in /dev/shm when either side dies.
"""

from __future__ import annotations

import logging
import os
import secrets

import torch

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_NONCE_BYTES = 16
_HEADER = 64  # the nonce, then the slots from a cache-line boundary
READY, FREE = 0, 1  # message kinds; the tag of bucket i's message is 2 * i + kind


# Kept by bench_cpu_tunings' row "weight sync into the CPU server: loopback gloo vs shared memory" (>= 1.1x).
class SharedSlots:
    """Two bucket-sized slots in one shared mapping."""

    def __init__(self, path: str, slot_bytes: int, mapping: torch.Tensor):
        self.path, self.slot_bytes, self.mapping = path, slot_bytes, mapping
        self._tick = torch.zeros(1, dtype=torch.uint8)

    @classmethod
    def create(cls, slot_bytes: int, directory: str = SHM_DIR) -> tuple[SharedSlots, str] | None:
        """The trainer's side: a new mapping and its nonce (hex), or None where `directory` lacks the room."""
        size = _HEADER + 2 * slot_bytes
        try:
            st = os.statvfs(directory)
        except OSError:
            return None
        if st.f_bavail * st.f_frsize < size + (64 << 20):  # a Docker /dev/shm is 64 MB: leave it be
            logger.info(
                "weight sync: %s has no room for 2 x %d MB buckets; syncing over gloo", directory, slot_bytes >> 20
            )
            return None
        path = os.path.join(directory, f"vf-rl-sync-{secrets.token_hex(8)}")
        nonce = secrets.token_bytes(_NONCE_BYTES)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserve every page now: a sparse file whose tmpfs filled up later would kill the first process to
            # write there with SIGBUS; a reservation that fails here only means gloo.
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            logger.info("weight sync: cannot reserve %d MB in %s (%s); syncing over gloo", size >> 20, directory, e)
            return None
        os.close(fd)
        mapping = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        mapping[:_NONCE_BYTES].copy_(torch.frombuffer(bytearray(nonce), dtype=torch.uint8))
        return cls(path, slot_bytes, mapping), nonce.hex()

    @classmethod
    def open(cls, path: str, nonce_hex: str, slot_bytes: int) -> SharedSlots | None:
        """The receiver's side: the trainer's mapping, or None where this process cannot see it."""
        size = _HEADER + 2 * slot_bytes
        if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith("vf-rl-sync-"):
            return None  # only the trainer's own kind of file
        try:
            if not os.path.isfile(path) or os.path.getsize(path) != size:
                return None
            mapping = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            expected = bytes.fromhex(nonce_hex)
        except (OSError, RuntimeError, ValueError):
            return None
        if bytes(mapping[:_NONCE_BYTES].tolist()) != expected:
            return None
        return cls(path, slot_bytes, mapping)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def slot(self, i: int, nbytes: int) -> torch.Tensor:
        start = _HEADER + (i % 2) * self.slot_bytes
        return self.mapping[start : start + nbytes]

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    def send(self, pg, peer: int, i: int, kind: int):
        return pg.send([self._tick], peer, 2 * i + kind)

    def recv(self, pg, peer: int, i: int, kind: int):
        return pg.recv([torch.zeros(1, dtype=torch.uint8)], peer, 2 * i + kind)
