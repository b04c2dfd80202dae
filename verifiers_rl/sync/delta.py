"""Send only what changed (sync_changed_only), behind one seam: a sender calls `Changes.sending`, a receiver
`receiving`. In full fine-tuning most bf16 elements keep their value through an optimizer step (their fp32 master
moved less than half a bf16 step), so a sync need only carry the elements whose wire-dtype bits changed: per tensor,
the flat indices and the new values (`Sparse`), or the whole tensor where that is smaller, or nothing.

The trainer keeps the last-sent wire-dtype copy of every tensor (`Changes`), updated with the same `apply` the
receiver runs so the two stay equal, and the version the server holds it as: changes are only valid against that
version, and any doubt is a whole sync. Over gloo the sparse parts travel as ordinary tensors (`<name>#delta_index`,
`<name>#delta_values`) through the bucket path, with a header (`UpdateInfo.delta`) naming the base version and the
whole tensors they update; over NCCL they go to vLLM's sparse engine as patches (sync/transport/sparse_nccl.py).
The receiver (`Receiving`) pairs them back into updates, written by our CPU engine's `load_weights` with `apply`, or
through a vLLM model's checkpoint loader (`through`, below).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from verifiers_rl.sync.buckets import TensorMeta, UpdateInfo
from verifiers_rl.sync.stream import WeightStream
from verifiers_rl.sync.verify import tensor_checksum

INDEX_SUFFIX = "#delta_index"
VALUE_SUFFIX = "#delta_values"
# Integer dtypes of each element size: changes are compared bit for bit (NaN == NaN, -0.0 != 0.0, as the bytes)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_HEADER = {"base_version", "names", "dtype_names", "shapes"}


@dataclass
class Sparse:
    """Flat indices (int32 where they fit, else int64) into a tensor and the new values there."""

    index: torch.Tensor
    values: torch.Tensor


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= 2**31 - 1 else torch.int64


def sparse_nbytes(changed: int, numel: int, elem_size: int) -> int:
    return changed * (index_dtype(numel).itemsize + elem_size)


def _bits(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if old.dtype != new.dtype or old.shape != new.shape:
        raise ValueError(f"cannot compare {old.dtype}{tuple(old.shape)} with {new.dtype}{tuple(new.shape)}")
    bits = _BITS[old.element_size()]
    return old.reshape(-1).view(bits), new.detach().reshape(-1).view(bits)


def changed_mask(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Flat bool mask of the elements whose bits differ."""
    a, b = _bits(old, new)
    return a != b


def diff(old: torch.Tensor, new: torch.Tensor, threshold: float = 1.0) -> Sparse | torch.Tensor | None:
    """What turns `old` into `new`: None (nothing changed), a `Sparse` update, or `new` itself (dense) when the
    sparse update would take more than `threshold` times the whole tensor's bytes (1.0: the break-even).

    On the CPU in numpy, single-threaded: torch's element-wise ops and nonzero run on every intra-op thread, and on
    a CPU shared by trainer and server each of a sync's hundreds of them waits for a descheduled thread (2.1 s
    instead of 0.16 s for 15M bf16 elements, measured on 2 loaded cores)."""
    a, b = _bits(old, new)
    on_cpu = old.device.type == "cpu"
    if on_cpu:
        a, b = a.numpy(), b.numpy()
    mask = a != b
    changed = int(np.count_nonzero(mask) if on_cpu else mask.sum())
    if changed == 0:
        return None
    numel, size = new.numel(), new.element_size()
    if sparse_nbytes(changed, numel, size) > threshold * numel * size:
        return new
    if not on_cpu:
        index = mask.nonzero().squeeze(1).to(index_dtype(numel))
        return Sparse(index, new.detach().reshape(-1)[index])
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
        if flat.device.type == "cpu" and update.index.device.type == "cpu":  # single-threaded, as `diff`
            bits = _BITS[flat.element_size()]
            flat.view(bits).numpy()[update.index.numpy()] = values.view(bits).numpy()
        else:
            flat.index_copy_(0, update.index.to(flat.device, torch.int64), values.to(flat.device))


def wire_items(name: str, update: Sparse | torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The tensors an update travels as over gloo."""
    if isinstance(update, Sparse):
        return [(name + INDEX_SUFFIX, update.index), (name + VALUE_SUFFIX, update.values)]
    return [(name, update)]


class Changes:
    """Trainer side: the last-sent wire-dtype tensors and the version the server holds them as (None: nothing valid
    to diff against). One per sender, so per weight group: a replaced server gets a new one."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.diffed = 0  # syncs sent as changes (benchmarks and tests count them)

    @contextlib.contextmanager
    def sending(self, stream: WeightStream, served: Callable[[], str | None], version: int) -> Iterator[Outgoing]:
        """Around one sync of `stream` as `version`: changes against the snapshot when the server (`served()`)
        holds exactly the snapshot's version; every tensor otherwise (a restart, a replaced server, a version moved
        without us). The snapshot holds `version` once the sync landed, nothing if it failed: the server may hold
        anything, the next sync is whole."""
        try:
            held = self.tensors
            fits = len(stream.metas) == len(held) and all(
                m.name in held and held[m.name].dtype == m.dtype and held[m.name].shape == m.shape for m in stream.metas
            )
            base = self.version if self.version is not None and fits and served() == str(self.version) else None
            if base is None:
                self.tensors, self.version = {}, None
            else:
                self.diffed += 1
            yield Outgoing(self, stream, base)
        except BaseException:
            self.tensors, self.version = {}, None
            raise
        self.version = version

    def relabel(self, version: int, was: int | None) -> None:
        """The server serves the weights it held as `was` as `version` now (a step that trained nothing)."""
        if self.version is not None and self.version == was:
            self.version = version


class Outgoing:
    """One sync as it travels: `updates()` per tensor (a sender that makes its own patches), `wire()` as tensors
    for buckets; `header` (None for a whole sync) describes it to the receivers, `targets` and `checksums` are the
    whole tensors it leaves on the server (our CPU engine reports checksums of those, read back)."""

    def __init__(self, changes: Changes, stream: WeightStream, base: int | None):
        self.changes, self.stream, self.base = changes, stream, base
        self.targets: list[TensorMeta] = list(stream.metas)
        self.checksums: list[int] = []
        whole = UpdateInfo.from_metas(self.targets).to_dict()
        self.header = None if base is None else {"base_version": str(base), **whole}

    def updates(self) -> Iterator[tuple[str, Sparse | torch.Tensor]]:
        """(name, update) for each tensor that changed, the snapshot then holding the new tensors; with no base,
        every tensor whole: the snapshot's copy (a stream's tensor may be a view its producer reuses)."""
        held = self.changes.tensors
        for name, t in self.stream:
            if self.base is None:
                held[name] = t.detach().clone()
                yield name, held[name]
                continue
            update = diff(held[name], t)
            if update is not None:
                apply(held[name], update)
                yield name, update if isinstance(update, Sparse) else held[name]

    def wire(self) -> WeightStream:
        """Every tensor whole, recorded as it passes; or the changes, made up front (a bucket plan needs them
        described), with the checksums of the targets."""
        if self.base is None:
            return WeightStream(self.targets, self.updates)
        items = [item for name, update in self.updates() for item in wire_items(name, update)]
        self.checksums = [tensor_checksum(self.changes.tensors[m.name]) for m in self.targets]
        return WeightStream([TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in items], lambda: iter(items))


def receiving(info: UpdateInfo, served: int | None = None) -> Receiving | None:
    """The receiver's side of a sync of changes, None for a sync of whole tensors (see `Receiving`)."""
    return None if info.delta is None else Receiving(info.delta, served)


class Receiving:
    """One sync of changes, receiver side. A malformed header is a ValueError before anything is received; a header
    of another base than `served` (where the receiver knows it) is `refused`, raised once the buckets are drained
    (the trainer is mid-broadcast). An index and its values may arrive in two buckets: the index is copied out of
    the staging buffer until they meet."""

    def __init__(self, header: dict, served: int | None = None):
        if not isinstance(header, dict) or set(header) != _HEADER:
            raise ValueError("update_info.delta needs exactly base_version, names, dtype_names and shapes")
        if not len(header["names"]) == len(header["dtype_names"]) == len(header["shapes"]):
            raise ValueError("update_info.delta lists differ in length")
        self.targets = UpdateInfo(header["names"], header["dtype_names"], header["shapes"]).metas()
        base, self.refused = header["base_version"], None
        if served is not None and str(base) != str(served):
            self.refused = ValueError(f"a delta against version {base} cannot apply to version {served}")
        self._index: tuple[str, torch.Tensor] | None = None
        self._wire: dict[str, list[str]] = {}  # target -> the names it arrived as

    def updates(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Sparse | torch.Tensor]]:
        """The received tensors as (target name, whole tensor | `Sparse`)."""
        for name, t in named:
            target = name.removesuffix(INDEX_SUFFIX).removesuffix(VALUE_SUFFIX)
            self._wire.setdefault(target, []).append(name)
            if name.endswith(INDEX_SUFFIX):
                self._index = (target, t)
            elif name.endswith(VALUE_SUFFIX):
                if self._index is None or self._index[0] != target:
                    raise ValueError(f"delta values for {target!r} arrived without their indices")
                index, self._index = self._index[1], None
                yield target, Sparse(index, t)
            else:
                yield name, t
        if self._index is not None:  # its values are in the next bucket; this buffer is about to be reused
            self._index = (self._index[0], self._index[1].clone())

    @torch.no_grad()
    def through(self, named: Iterable[tuple[str, torch.Tensor]], load_weights: Callable) -> list[str]:
        """One bucket through a checkpoint loader (a vLLM model's `load_weights`), in place, then compared where it
        landed: the names, as received, of the tensors whose changes the parameters do not hold."""
        updates = list(self.updates(named))
        targets = {m.name: m for m in self.targets}
        write_through(load_weights, updates, targets)
        return [wire for name in not_landed(load_weights, updates, targets) for wire in self._wire[name]]


# A sync of changes into vLLM's parameters follows its checkpoint-patch contract
# (model_loader/checkpoint_weight_patch.py, what its sparse_nccl engine applies): each checkpoint tensor goes to the
# model's `load_weights` with NaN at every element that did not change, and the loader's final `Tensor.copy_`
# becomes "copy where not NaN". So the model's own name mapping, fusing, vocabulary padding and tensor-parallel
# slicing place each changed element; nothing here knows a model's layout. In place means no layerwise reload,
# which holds for unquantized weights on a GPU (vLLM's CPU build repacks them: inference/vllm/gloo_engine.py
# refuses there). vLLM's own patch function swaps `Tensor.copy_` for every thread of the process; a
# TorchFunctionMode is torch's scoped hook: it sees the copies of the thread that entered it, and no other's.


class _FinalCopy(torch.overrides.TorchFunctionMode):
    """`Tensor.copy_` is `write(destination, source)` in this thread for the duration."""

    def __init__(self, write: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        super().__init__()
        self.write = write

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            return self.write(args[0], args[1])
        return func(*args, **(kwargs or {}))


def _final_copy(destination: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """The source of the loader's final copy, checked against vLLM's contract (one same-shaped float copy)."""
    if not (destination.is_floating_point() and source.is_floating_point() and destination.shape == source.shape):
        raise ValueError(
            f"this model's loader does not end in one same-shaped floating-point copy ({tuple(source.shape)} into "
            f"{tuple(destination.shape)}): a sync of changes cannot be written into it"
        )
    return source.to(dtype=destination.dtype, device=destination.device)


def _copy_where_changed(destination: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    source = _final_copy(destination, source)
    return torch.where(torch.isnan(source), destination, source, out=destination)


def _masked(update: Sparse | torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """The checkpoint-shaped tensor the loader gets: NaN where nothing changed; a whole tensor as it is."""
    if not isinstance(update, Sparse):
        return update.reshape(meta.shape)
    values = update.values.to(dtype=meta.dtype)
    if bool(torch.isnan(values).any()):  # NaN means "unchanged" here: a NaN weight must not pass as no change
        raise ValueError(f"the trainer's {meta.name} holds NaN: the policy has diverged")
    flat = torch.full((math.prod(meta.shape),), float("nan"), dtype=meta.dtype, device=values.device)
    flat.index_copy_(0, update.index.to(values.device, torch.long), values)
    return flat.view(meta.shape)


@torch.no_grad()
def write_through(load_weights: Callable, updates: list, targets: dict[str, TensorMeta]) -> None:
    """Write `updates` (whole tensors or `Sparse` changes, checkpoint names) through the loader, in place."""
    whole = [(name, u.reshape(targets[name].shape)) for name, u in updates if not isinstance(u, Sparse)]
    if whole:
        load_weights(whole)
    for name, update in updates:  # one tensor at a time: each NaN-masked copy is as large as the whole tensor
        if isinstance(update, Sparse):
            masked = _masked(update, targets[name])
            with _FinalCopy(_copy_where_changed):
                load_weights([(name, masked)])


@torch.no_grad()
def not_landed(load_weights: Callable, updates: list, targets: dict[str, TensorMeta]) -> list[str]:
    """The names among `updates` whose changed elements the parameters do not hold: loaded once more with the final
    copy turned into a comparison with the parameter it was written to. A tensor the loader takes nothing from (a
    tied lm_head) passes, as in a sync of whole tensors."""
    same: list[bool] = []

    def compare(destination: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        source = _final_copy(destination, source)
        same.append(bool(torch.where(torch.isnan(source), True, destination == source).all()))
        return destination

    bad = []
    for name, update in updates:
        same.clear()
        with _FinalCopy(compare):
            load_weights([(name, _masked(update, targets[name]))])
        if not all(same):
            bad.append(name)
    return bad
