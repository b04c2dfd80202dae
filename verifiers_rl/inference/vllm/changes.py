"""A sync of changes only (sync/delta.py) into a vLLM worker, written in place through vLLM's own checkpoint-patch
loader (`load_checkpoint_weight_patches`, vLLM >= 0.32).

That loader hands each checkpoint tensor to the model's `load_weights` with NaN at every element that did not change
and turns the loader's final `copy_` into "copy where not NaN". So the model's own name mapping, fusing (q/k/v into
qkv_proj, gate/up into gate_up_proj), vocabulary padding and tensor-parallel slicing place each changed element;
nothing here knows a model's layout. In place means no layerwise reload: the parameters the kernels read are the
ones written, which holds for unquantized weights on a GPU. vLLM's CPU build keeps its linear layers only as packed
kernel handles and empties the parameters (`packed_away`), so a worker there refuses a sync of changes.

`not_landed` checks the result the same way: the updates are loaded once more with the final `copy_` turned into a
comparison, so each changed element is compared with the runtime parameter it was written to, wherever the mapping
put it.
"""

from __future__ import annotations

import math

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


def _patch(name: str, update, meta: TensorMeta):
    from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch

    if isinstance(update, Sparse):
        return CheckpointWeightPatch(name, meta.shape, meta.dtype, update.values.reshape(-1), update.index)
    return CheckpointWeightPatch(name, meta.shape, meta.dtype, update.reshape(-1))


def load_changes(model: torch.nn.Module, updates: list[Update], targets: dict[str, TensorMeta]) -> None:
    """Write `updates` (whole tensors or `Sparse` changes, checkpoint names) into the model's runtime parameters.
    vLLM's loader takes sparse and whole patches in separate calls."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import load_checkpoint_weight_patches

    patches = [_patch(name, u, targets[name]) for name, u in updates]
    for sparse in (True, False):
        chosen = [p for p in patches if (p.indices is not None) == sparse]
        if chosen:
            load_checkpoint_weight_patches(model, chosen)


def _masked(update, meta: TensorMeta, device) -> torch.Tensor:
    """The checkpoint-shaped tensor vLLM's loader builds for a patch: NaN where nothing changed."""
    if not isinstance(update, Sparse):
        return update.reshape(meta.shape)
    flat = torch.full((math.prod(meta.shape),), float("nan"), dtype=meta.dtype, device=device)
    flat.index_copy_(0, update.index.to(device, torch.long), update.values.to(device, meta.dtype))
    return flat.view(meta.shape)


@torch.no_grad()
def not_landed(model: torch.nn.Module, updates: list[Update], targets: dict[str, TensorMeta]) -> list[str]:
    """The names among `updates` whose changed elements the runtime parameters do not hold. A tensor the model's
    loader takes nothing from (a tied lm_head) passes, as in a sync of whole tensors. Each is loaded again with
    `Tensor.copy_` replaced by a comparison that writes nothing: vLLM's sparse loader relies on the same contract
    (one final same-shaped copy per destination)."""
    original_copy = torch.Tensor.copy_
    seen: list[bool] = []

    def compare(destination: torch.Tensor, source: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        source = source.to(dtype=destination.dtype, device=destination.device)
        same = destination.shape == source.shape and bool(
            torch.where(torch.isnan(source), True, destination == source).all()
        )
        seen.append(same)
        return destination

    bad = []
    for name, update in updates:
        device = update.values.device if isinstance(update, Sparse) else update.device
        tensor = _masked(update, targets[name], device)
        seen.clear()
        torch.Tensor.copy_ = compare
        try:
            model.load_weights([(name, tensor)])
        finally:
            torch.Tensor.copy_ = original_copy
        if not all(seen):
            bad.append(name)
    return bad
