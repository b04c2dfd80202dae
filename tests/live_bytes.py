"""The peak of live tensor memory in a step on CPU, where tensors have no allocator statistics (the profiler's CPU
memory events proved unusable: they came back unordered, frees without their allocations).

`LiveBytes`, a TorchDispatchMode, sees every tensor an operator returns, records a storage the first time it
appears (its bytes and a serial number) and watches it with a weakref finalizer on the storage, which fires when
the last tensor using it is gone (torch keeps one Python object per live storage). The running sum of those
allocations and frees is the live memory of the step; its maximum is the peak, optionally leaving out some
allocations by serial number (not by address: the allocator reuses freed addresses). Used by
tests/unit/test_memory_measured.py and benchmarks/results/gpu_check_memory_counted.py.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """Allocations and frees of tensor storages created while the mode is active, left out the model's
    parameters and buffers that existed before (see the module's docstring)."""

    def __init__(self, model):
        super().__init__()
        self.before = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self.live: dict[int, tuple[int, int]] = {}  # address -> (serial, bytes)
        self.events: list[tuple[int, int]] = []  # (serial, +bytes allocated / -bytes freed)

    def _free(self, address: int) -> None:
        serial, size = self.live.pop(address)
        self.events.append((serial, -size))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                address = storage.data_ptr()
                if address and address not in self.live and address not in self.before:
                    self.live[address] = (len(self.events), storage.nbytes())
                    self.events.append((len(self.events), storage.nbytes()))
                    weakref.finalize(storage, self._free, address)
        return out

    def serials(self, tensors) -> set[int]:
        return {self.live[t.untyped_storage().data_ptr()][0] for t in tensors}

    def peak(self, leave_out: set[int]) -> int:
        now = top = 0
        for serial, size in self.events:
            if serial not in leave_out:
                now += size
                top = max(top, now)
        return top
