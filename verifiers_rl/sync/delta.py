"""Send only what changed: a sync as the differences from the last one, measured in the wire dtype.

In full fine-tuning most bf16 elements keep their value through an optimizer step (their fp32 master moved less
than half a bf16 step), so a sync need only carry the elements whose wire-dtype bits changed: per tensor, the flat
indices and the new values (`Sparse`), or the whole tensor where that is smaller (`dense`), or nothing.

The trainer keeps the last-sent wire-dtype copy of every tensor (`Snapshot`, on the tensors' own device: one extra
copy of the synced weights) and updates it with the same `apply` the receiver runs, so the two stay equal. A delta
is only valid against the version the server holds: the sender checks the server's version first, and our CPU
engine checks the delta's base version again (sync/transport/gloo.py, cpu/weight_receiver.py); any doubt is a full sync.

Over gloo the sparse parts travel as ordinary tensors (`<name>#delta_index`, `<name>#delta_values`) through the
same bucket path as full tensors; `UpdateInfo.delta` names the whole tensors they update. Our CPU engine reports
checksums of those whole tensors after applying; vLLM's workers report the tensors received and compare the changes
where they landed (inference/vllm/changes.py; sync/verify.py). Over NCCL they go to vLLM's sparse engine as patches
(sparse_nccl.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from verifiers_rl.sync.buckets import TensorMeta
from verifiers_rl.sync.stream import WeightStream
from verifiers_rl.sync.verify import tensor_checksum

INDEX_SUFFIX = "#delta_index"
VALUE_SUFFIX = "#delta_values"
_INT32_MAX = 2**31 - 1
# Integer dtypes of each element size: changes are compared bit for bit (NaN == NaN, -0.0 != 0.0, as the bytes)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Sparse:
    """Flat indices (int32 where they fit, else int64) into a tensor and the new values there."""

    index: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.index.numel() * self.index.element_size() + self.values.numel() * self.values.element_size()


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= _INT32_MAX else torch.int64


def sparse_nbytes(changed: int, numel: int, elem_size: int) -> int:
    """Bytes of a sparse update of `changed` elements of a tensor of `numel` elements."""
    return changed * (torch.empty((), dtype=index_dtype(numel)).element_size() + elem_size)


def _comparable(old: torch.Tensor, new: torch.Tensor) -> None:
    if old.dtype != new.dtype or old.shape != new.shape:
        raise ValueError(f"cannot compare {old.dtype}{tuple(old.shape)} with {new.dtype}{tuple(new.shape)}")


def changed_mask(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat bool mask of the elements whose bits differ (`old` and `new` of one dtype and shape)."""
    _comparable(old, new)
    bits = _BITS[old.element_size()]
    return old.reshape(-1).view(bits) != new.detach().reshape(-1).view(bits)


def diff(old: torch.Tensor, new: torch.Tensor, threshold: float = 1.0) -> Sparse | torch.Tensor | None:
    """What turns `old` into `new`: None (nothing changed), a `Sparse` update, or `new` itself (dense) when the
    sparse update would take more than `threshold` times the whole tensor's bytes (1.0: the break-even)."""
    if old.device.type == "cpu":
        return _cpu_diff(old, new, threshold)
    mask = changed_mask(old, new)
    changed = int(mask.sum())
    if changed == 0:
        return None
    numel, size = mask.numel(), new.element_size()
    if sparse_nbytes(changed, numel, size) > threshold * numel * size:
        return new
    index = mask.nonzero().squeeze(1).to(index_dtype(numel))
    return Sparse(index, new.detach().reshape(-1)[index])


def _cpu_diff(old: torch.Tensor, new: torch.Tensor, threshold: float) -> Sparse | torch.Tensor | None:
    """`diff` in numpy, the same result: single-threaded. torch's element-wise ops and nonzero run on every
    intra-op thread, and on a CPU shared by trainer and server each of a sync's hundreds of them waits for a
    descheduled thread (2.1 s instead of 0.16 s for 15M bf16 elements, measured on 2 loaded cores)."""
    _comparable(old, new)
    bits = _BITS[old.element_size()]
    a, b = old.reshape(-1).view(bits).numpy(), new.detach().reshape(-1).view(bits).numpy()
    mask = a != b
    changed = int(np.count_nonzero(mask))
    if changed == 0:
        return None
    numel, size = mask.size, new.element_size()
    if sparse_nbytes(changed, numel, size) > threshold * numel * size:
        return new
    index = np.flatnonzero(mask).astype(np.int32 if index_dtype(numel) == torch.int32 else np.int64)
    return Sparse(torch.from_numpy(index), torch.from_numpy(b[index]).view(new.dtype))


def apply(target: torch.Tensor, update: Sparse | torch.Tensor) -> None:
    """Apply a `diff` result to `target` in place (its own dtype: a float32 copy holds bf16 values exactly)."""
    with torch.no_grad():
        if not isinstance(update, Sparse):
            target.copy_(update)
            return
        flat = target.view(-1)  # a view: the update lands in target's own memory
        values = update.values.to(target.dtype)
        if flat.device.type == "cpu" and update.index.device.type == "cpu":  # single-threaded, as `_cpu_diff`
            bits = _BITS[flat.element_size()]
            flat.view(bits).numpy()[update.index.numpy()] = values.view(bits).numpy()
        else:
            flat.index_copy_(0, update.index.to(flat.device, torch.int64), values.to(flat.device))


def wire_items(name: str, update: Sparse | torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The tensors an update travels as (see the module docstring)."""
    if isinstance(update, Sparse):
        return [(name + INDEX_SUFFIX, update.index), (name + VALUE_SUFFIX, update.values)]
    return [(name, update)]


class Pairing:
    """Receiver side: turns a delta sync's received tensors back into (name, tensor | Sparse) updates. An index
    and its values may arrive in two buckets: the index is copied out of the staging buffer until they meet."""

    def __init__(self):
        self._index: tuple[str, torch.Tensor] | None = None

    def updates(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Sparse | torch.Tensor]]:
        for name, t in named:
            if name.endswith(INDEX_SUFFIX):
                self._index = (name.removesuffix(INDEX_SUFFIX), t)
            elif name.endswith(VALUE_SUFFIX):
                target = name.removesuffix(VALUE_SUFFIX)
                if self._index is None or self._index[0] != target:
                    raise ValueError(f"delta values for {target!r} arrived without their indices")
                index, self._index = self._index[1], None
                yield target, Sparse(index, t)
            else:
                yield name, t
        if self._index is not None:  # its values are in the next bucket; this buffer is about to be reused
            self._index = (self._index[0], self._index[1].clone())


@dataclass
class Delta:
    """One delta sync, trainer side: what travels, what it updates (the whole tensors the receivers report on)
    and the trainer's checksums of those whole tensors."""

    wire: WeightStream
    targets: list[TensorMeta]
    checksums: list[int]


class Snapshot:
    """The last-sent wire-dtype tensors and the version they were sent as (None: nothing valid to diff against)."""

    def __init__(self, threshold: float = 1.0):
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.threshold = threshold

    def valid_for(self, served_version: str | None, metas: list[TensorMeta]) -> bool:
        """Whether a delta against this snapshot fits a server that serves `served_version`."""
        if self.version is None or served_version != str(self.version) or len(metas) != len(self.tensors):
            return False
        held = self.tensors
        return all(m.name in held and held[m.name].dtype == m.dtype and held[m.name].shape == m.shape for m in metas)

    def forget(self) -> None:
        """A sync failed or was refused: the server may hold anything; the next sync is a full one."""
        self.tensors, self.version = {}, None

    @contextlib.contextmanager
    def sending(self, version: int):
        """Around one sync (delta or full): the snapshot holds `version` once it landed, nothing if it failed."""
        try:
            yield
        except BaseException:
            self.forget()
            raise
        self.version = version

    def recording(self, stream: WeightStream) -> WeightStream:
        """`stream` as it is, copying each tensor into the snapshot as it passes (a full sync)."""
        self.tensors, self.version = {}, None

        def produce():
            for name, t in stream:
                self.tensors[name] = t.detach().clone()
                yield name, t

        return WeightStream(stream.metas, produce)

    def updates(self, stream: WeightStream) -> Iterator[tuple[str, Sparse | torch.Tensor | None]]:
        """Diff every tensor of `stream` against the snapshot, which then holds the new tensors: (name, update),
        None where nothing changed. A dense update is the snapshot's tensor (a stream's tensor may be a view its
        producer reuses)."""
        for name, t in stream:
            held = self.tensors[name]
            update = diff(held, t, self.threshold)
            if update is not None:
                apply(held, update)
            yield name, held if update is not None and not isinstance(update, Sparse) else update

    def delta(self, stream: WeightStream) -> Delta:
        """`updates` as the tensors a bucketed sync moves, and the checksums of the whole tensors they update."""
        wire: list[tuple[str, torch.Tensor]] = []
        sums: list[int] = []
        for name, update in self.updates(stream):
            if update is not None:
                wire += wire_items(name, update)
            sums.append(tensor_checksum(self.tensors[name]))
        metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in wire]
        return Delta(WeightStream(metas, lambda: iter(wire)), list(stream.metas), sums)
