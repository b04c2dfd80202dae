"""Bucketed weight transfer: both peers derive the same bucket plan from (names, dtypes, shapes, bucket size),
so one control request describes a whole sync and the data moves in a few large broadcasts.

A bucket is a flat uint8 buffer holding consecutive tensors' raw bytes (mixed dtypes are fine); a tensor larger
than the bucket size travels alone. Per-tensor broadcasts were what made the old design's syncs take minutes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

# Small enough that packing the next bucket overlaps sending this one, large enough that per-broadcast
# overhead vanishes; both peers keep two buckets of staging memory.
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    metas: tuple[TensorMeta, ...]
    offsets: tuple[int, ...]  # byte offset of each tensor inside the bucket
    nbytes: int


def consecutive(items: list, nbytes: Callable, bucket_bytes: int) -> Iterator[list]:
    """Consecutive items of at most `bucket_bytes` in all (a larger item makes a group of its own)."""
    group, size = [], 0
    for item in items:
        if group and size + nbytes(item) > bucket_bytes:
            yield group
            group, size = [], 0
        group.append(item)
        size += nbytes(item)
    if group:
        yield group


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    buckets = []
    for group in consecutive(metas, lambda m: m.nbytes, bucket_bytes):
        ends = list(itertools.accumulate(m.nbytes for m in group))
        buckets.append(Bucket(tuple(group), (0, *ends[:-1]), ends[-1]))
    return buckets


def pack(bucket: Bucket, tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy `tensors` (in bucket order) into one flat uint8 buffer."""
    buf = out if out is not None else torch.empty(bucket.nbytes, dtype=torch.uint8)
    for meta, off, t in zip(bucket.metas, bucket.offsets, tensors):
        if t.dtype != meta.dtype or tuple(t.shape) != meta.shape:
            raise ValueError(
                f"tensor {meta.name!r} is {t.dtype}{tuple(t.shape)}, its plan says {meta.dtype}{meta.shape}"
            )
        buf[off : off + meta.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return buf


def unpack(bucket: Bucket, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views into `buf`, one per tensor: no copy. Copy them out before reusing `buf`. A tensor whose offset is not
    a multiple of its element size (a delta sync's int32 indices behind an odd number of bf16 values) cannot be
    viewed there: it is copied out, aligned."""
    out = []
    for meta, off in zip(bucket.metas, bucket.offsets):
        raw = buf[off : off + meta.nbytes]
        if raw.data_ptr() % meta.dtype.itemsize:
            raw = raw.clone()
        out.append((meta.name, raw.view(meta.dtype).view(meta.shape)))
    return out


@dataclass
class UpdateInfo:
    """Body of `/update_weights`' `update_info`: the whole sync described up front, in vLLM's own format (so
    the same payload serves vLLM's NCCL engine, our gloo plugin for vLLM and our CPU engine)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    # Ours (gloo): the id under which each receiving rank leaves its checksums in the trainer's store (verify.py).
    report: str = ""
    # Ours: the header of a sync of changes only, made and read by sync/delta.py alone.
    delta: dict | None = None

    def __post_init__(self):
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n:
            raise ValueError(
                f"update_info lists differ in length: names={n} dtype_names={len(self.dtype_names)} "
                f"shapes={len(self.shapes)}"
            )

    @classmethod
    def from_metas(cls, metas: list[TensorMeta], report: str = "") -> UpdateInfo:
        dtypes = [str(m.dtype).removeprefix("torch.") for m in metas]
        return cls([m.name for m in metas], dtypes, [list(m.shape) for m in metas], report)

    @classmethod
    def parse(cls, info: dict) -> UpdateInfo:
        """From a request body; a missing or unknown key is a ValueError (the server answers 400)."""
        if not isinstance(info, dict):
            raise ValueError(f"update_info must be an object, got {type(info).__name__}")
        fields = {"names", "dtype_names", "shapes"}
        unknown = set(info) - fields - {"report", "delta"}
        missing = fields - set(info)
        if unknown or missing:
            raise ValueError(f"update_info: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}")
        return cls(**info)

    def to_dict(self) -> dict:
        out = {"names": self.names, "dtype_names": self.dtype_names, "shapes": self.shapes}
        if self.report:
            out["report"] = self.report
        return {**out, "delta": self.delta} if self.delta is not None else out

    def metas(self) -> list[TensorMeta]:
        try:
            shapes = [tuple(int(x) for x in s) for s in self.shapes]
            return [TensorMeta(*m) for m in zip(self.names, map(dtype_from_name, self.dtype_names), shapes)]
        except (TypeError, ValueError) as e:
            raise ValueError(f"update_info: {e}") from None
