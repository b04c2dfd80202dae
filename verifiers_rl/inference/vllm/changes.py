"""A sync of changes only (sync/delta.py) into a vLLM worker, written in place through the model's own loader.

This is vLLM's checkpoint-patch contract (`model_loader/checkpoint_weight_patch.py`, what its `sparse_nccl` engine
applies): each checkpoint tensor goes to the model's `load_weights` with NaN at every element that did not change,
and the loader's final `Tensor.copy_` becomes "copy where not NaN". So the model's own name mapping, fusing (q/k/v
into qkv_proj, gate/up into gate_up_proj), vocabulary padding and tensor-parallel slicing place each changed
element; nothing here knows a model's layout. vLLM's function swaps `Tensor.copy_` for every thread of the
process; `_writes` swaps it for the loading thread only, so another thread's copies (a trainer in the same process,
the worker's own threads) stay copies. That is why this is not a call to vLLM's function.

In place means no layerwise reload: the parameters the kernels read are the ones written, which holds for
unquantized weights on a GPU. vLLM's CPU build keeps its linear layers only as packed kernel handles and empties the
parameters (`packed_away`), so a worker there refuses a sync of changes.

`not_landed` checks the result the same way: the updates are loaded once more with the final `copy_` turned into a
comparison, so each changed element is compared with the runtime parameter it was written to, wherever the mapping
put it.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable

import torch

from verifiers_rl.sync.buckets import TensorMeta
from verifiers_rl.sync.delta import Sparse

Update = tuple[str, "Sparse | torch.Tensor"]


def packed_away(model: torch.nn.Module) -> str | None:
    """The first parameter vLLM emptied after repacking its weights for a kernel, or None: a change has nowhere to
    be written there (vLLM's CPU build does this to every linear layer)."""
    for name, p in model.named_parameters():
        if p.numel() == 0:
            return name
    return None


@contextlib.contextmanager
def _writes(write: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """`Tensor.copy_` is `write` in this thread for the duration; other threads keep the real one."""
    original, owner = torch.Tensor.copy_, threading.get_ident()

    def copy_(destination, source, non_blocking=False):
        if threading.get_ident() != owner:
            return original(destination, source, non_blocking)
        return write(destination, source)

    torch.Tensor.copy_ = copy_
    try:
        yield
    finally:
        torch.Tensor.copy_ = original


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
def load_changes(model: torch.nn.Module, updates: list[Update], targets: dict[str, TensorMeta]) -> None:
    """Write `updates` (whole tensors or `Sparse` changes, checkpoint names) into the model's runtime parameters."""
    whole = [(name, u.reshape(targets[name].shape)) for name, u in updates if not isinstance(u, Sparse)]
    if whole:
        model.load_weights(whole)
    for name, update in updates:  # one tensor at a time: each NaN-masked copy is as large as the whole tensor
        if isinstance(update, Sparse):
            masked = _masked(update, targets[name])
            with _writes(_copy_where_changed):
                model.load_weights([(name, masked)])


@torch.no_grad()
def not_landed(model: torch.nn.Module, updates: list[Update], targets: dict[str, TensorMeta]) -> list[str]:
    """The names among `updates` whose changed elements the runtime parameters do not hold. A tensor the model's
    loader takes nothing from (a tied lm_head) passes, as in a sync of whole tensors."""
    same: list[bool] = []

    def compare(destination: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        source = _final_copy(destination, source)
        same.append(bool(torch.where(torch.isnan(source), True, destination == source).all()))
        return destination

    bad = []
    for name, update in updates:
        same.clear()
        masked = _masked(update, targets[name])
        with _writes(compare):
            model.load_weights([(name, masked)])
        if not all(same):
            bad.append(name)
    return bad
