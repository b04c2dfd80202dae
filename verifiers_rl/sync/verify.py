"""Did a sync land? Both sides checksum every tensor of a sync the same way, from its bytes, and compare.

The trainer checksums each tensor as its stream produced it, while sending (`wire.send_buckets`). Each receiving
rank checksums what it loaded: our CPU engine reads its parameters back (so a tensor received but never written
shows); a vLLM worker checksums the tensors it hands to `model.load_weights` (its own parameters are fused and
sharded); adapter sync checksums the A/B tensors each receiver installs. Each rank leaves its list in the trainer's
store (`gloo.publish_report`: vLLM's /collective_rpc answers for data-parallel engine 0 only), and `verify` compares
rank by rank. A difference stops the run with one line; there is no retry: a sync that went wrong once says
something is broken. vLLM's NCCL engines report nothing: the mismatch_kl guard (sync/guard.py) covers every
backend, and catches wrong bytes both sides agree on (a wrongly gathered shard).

The checksum is memory-bandwidth bound (8-12 GB/s on one CPU core): the bytes as 64-bit words, summed per block of
8 KiB, then the block sums summed plain and weighted by block index, all modulo 2**64 (integer arithmetic, so
every device, library and summation order gives the same answer); the bytes past the last whole word and the
length are mixed in. Floats are never summed as floats: bf16 and fp32 bytes are checked alike.
"""

from __future__ import annotations

import os

import numpy as np
import torch

_BLOCK = 1024  # 64-bit words per block: position sensitivity at 8 KiB granularity, at the speed of a plain sum
_MASK = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant (golden ratio), so the two sums do not cancel each other
FAULT_ENV = "VF_TEST_SYNC_FAULT"  # tests only: break a receiver on purpose (`dropped_buckets`)


class SyncMismatch(RuntimeError):
    """A sync whose receivers hold other bytes than the trainer sent; the message is the whole story."""


def tensor_checksum(t: torch.Tensor) -> int:
    """A 64-bit checksum of `t`'s bytes (any dtype, any device; the same bytes give the same number)."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = b.numel()
    whole = n - n % 8
    words = b[:whole]
    if words.data_ptr() % 8 or words.storage_offset() % 8:  # unaligned (a bf16 view behind another): copied
        words = words.clone()
    words = words.view(torch.int64)
    plain, weighted = (_cpu_sums if words.device.type == "cpu" else _torch_sums)(words)
    tail = int.from_bytes(bytes(b[whole:].cpu().tolist()), "little") if whole < n else 0
    return ((plain & _MASK) * _MIX + (weighted & _MASK) + tail * 31 + n) & _MASK


def _torch_sums(words: torch.Tensor) -> tuple[int, int]:
    """(sum of the words, sum of the block sums weighted by block index) on the tensor's device (a vLLM GPU)."""
    rows = words.numel() // _BLOCK
    blocks = words[: rows * _BLOCK].view(rows, _BLOCK).sum(1)
    index = torch.arange(1, rows + 1, dtype=torch.int64, device=blocks.device)
    return int(blocks.sum()) + int(words[rows * _BLOCK :].sum()), int((blocks * index).sum())


def _cpu_sums(words: torch.Tensor) -> tuple[int, int]:
    """`_torch_sums` in numpy, single-threaded: torch's reductions run on every intra-op thread, and on a busy CPU
    each of a sync's hundreds of small parallel reductions waits for a descheduled thread, up to 100x slower
    (benchmarks/results/design_measurements.md#checksums)."""
    w = words.numpy()
    rows = w.size // _BLOCK
    blocks = w[: rows * _BLOCK].reshape(rows, _BLOCK).sum(axis=1, dtype=np.int64)
    index = np.arange(1, rows + 1, dtype=np.int64)
    plain = int(blocks.sum(dtype=np.int64)) + int(w[rows * _BLOCK :].sum(dtype=np.int64))
    return plain, int((blocks * index).sum(dtype=np.int64))


def verify(version: int, names: list[str], nbytes: list[int], sent: list[int], reports: dict[int, dict]) -> None:
    """Compare every receiving rank's checksums (`reports[rank]["checksums"]`, in `names` order, None where it
    loaded nothing) with the trainer's; raise SyncMismatch naming the sync, the rank, the tensors and the bytes."""
    for rank, report in sorted(reports.items()):
        got = report.get("checksums")
        if not isinstance(got, list) or len(got) != len(names):
            count = "no" if not isinstance(got, list) else f"{len(got)} of {len(names)}"
            raise SyncMismatch(
                f"weight sync to version {version} cannot be verified: inference rank {rank} reported {count} "
                "checksums; the server runs another verifiers-rl version than the trainer: install the same on both"
            )
        missing = [i for i, g in enumerate(got) if g is None]
        differ = [i for i, g in enumerate(got) if g is not None and g != sent[i]]
        if missing or differ:
            raise SyncMismatch(_mismatch_line(version, rank, names, nbytes, missing, differ))


def _mismatch_line(version, rank, names, nbytes, missing, differ) -> str:
    bad = missing + differ
    shown = ", ".join(names[i] for i in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    parts = []
    if differ:
        parts.append(_count(len(differ), "tensor holds", "tensors hold") + " other bytes than were sent")
    if missing:
        parts.append(_count(len(missing), "tensor was", "tensors were") + " never loaded")
    return (
        f"weight sync to version {version} did not land on inference rank {rank}: {' and '.join(parts)} ({shown}; "
        f"{sum(nbytes[i] for i in bad)} of the sync's {sum(nbytes)} bytes, {len(names)} tensors); the server would "
        "sample from weights the trainer does not have, so the run stops: see the server's log"
    )


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def dropped_buckets(count: int, rank: int) -> set[int]:
    """Tests only: the buckets the receiver of gloo rank `rank` drops on purpose, from $VF_TEST_SYNC_FAULT in the
    server's environment: `stale` (acknowledge the sync, load nothing) or `skip-bucket:<i>` (drop bucket i's
    tensors), optionally `@<rank>` for one receiving rank only (data-parallel engine 1 is rank 2). Empty otherwise."""
    fault, _, only = os.environ.get(FAULT_ENV, "").partition("@")
    if only and int(only) != rank:
        return set()
    if fault == "stale":
        return set(range(count))
    if fault.startswith("skip-bucket:"):
        return {min(int(fault.split(":", 1)[1]), count - 1)}
    return set()
