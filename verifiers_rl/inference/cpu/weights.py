"""The served weights of a CPU engine, and how a sync replaces them: full tensors copied in place, or LoRA A/B
pairs applied as W = W0 + scaling * B @ A against the pristine base weights (adapter sync). Both CPU engines inherit
this; each wraps `load_weights` in its own lock so a sync never lands between two layers of a forward pass.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod

import torch

from verifiers_rl.sync.verify import tensor_checksum


class ServedWeights(ABC):
    """Mixin for an engine that holds `self.model` and serves policy `self.version`."""

    model: torch.nn.Module
    version: int

    @classmethod
    def from_pretrained(cls, name_or_path: str, **kwargs):
        from verifiers_rl.models import get_model, get_tokenizer

        return cls(get_model(name_or_path, device="cpu"), get_tokenizer(name_or_path), **kwargs)

    def _init_weights(self) -> None:
        self.version = 0
        self._pristine: dict[str, torch.Tensor] = {}  # base weights kept for adapter-only LoRA sync
        self._overwritten: set[str] = set()  # weights replaced by full tensors before any pristine copy
        self._params = dict(self.model.named_parameters())  # looked up per received tensor on every sync

    def flatten_parameters(self) -> None:
        """Lay every parameter out in one buffer, in `named_parameters()` order, each parameter a view of it: the
        trainer sends merged weights in that order, so each tensor of a bucket arrives in its own span directly
        (`placement`), with no staging copy. The lean decoder packs q/k/v and gate/up as views of adjacent spans.
        Skipped for mixed dtypes."""
        params = list(self.model.named_parameters())
        dtypes = {p.dtype for _, p in params}
        if len(dtypes) != 1:
            return
        sizes = [p.numel() * p.element_size() for _, p in params]
        offsets = [0, *itertools.accumulate(sizes)][:-1]
        arena = torch.empty(sum(sizes), dtype=torch.uint8)
        spans = {}
        with torch.no_grad():
            for (name, p), offset, size in zip(params, offsets, sizes):
                view = arena[offset : offset + size].view(p.dtype).view(p.shape)
                view.copy_(p.detach())
                p.data = view
                spans[name] = (offset, size, p.dtype, tuple(p.shape))
        self._arena, self._spans = arena, spans

    def placement(self, bucket) -> list[torch.Tensor] | None:
        """Where each tensor of a bucket of full tensors belongs, as uint8 views of the served parameters, in bucket
        order; None when any of them has no such place (the bucket is then staged and copied by `load_weights`)."""
        spans = getattr(self, "_spans", None)
        if not spans:
            return None
        base, views = self._arena.data_ptr(), []
        for meta in bucket.metas:
            span = spans.get(meta.name)
            if span is None or span[2] != meta.dtype or span[3] != tuple(meta.shape):
                return None
            if self._params[meta.name].data_ptr() != base + span[0]:  # replaced since (param.data = ...): stale span
                return None
            views.append(self._arena[span[0] : span[0] + span[1]])
        for meta in bucket.metas:  # as load_weights records a full-tensor copy
            if meta.name not in self._pristine:
                self._overwritten.add(meta.name)
        return views

    def load_weights(self, named_tensors, *, lora_scaling: float | None = None, write=None) -> int:
        """Copy tensors into the model (HF names), or write them with `write(parameter, update)` (a sync of changes
        only passes its own, sync/delta.py). With `lora_scaling`, `X.lora_A`/`X.lora_B` pairs become X.weight = X0 +
        scaling * B @ A against pristine base weights; other names are copied as they are."""
        params, write = self._params, write or torch.Tensor.copy_
        pending: dict[str, dict[str, torch.Tensor]] = {}
        count = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                if lora_scaling is not None and (name.endswith(".lora_A") or name.endswith(".lora_B")):
                    module, kind = name.rsplit(".", 1)
                    pending.setdefault(module, {})[kind] = tensor.clone()
                    if len(pending[module]) == 2:
                        self._merge_adapter(params, module, pending.pop(module), lora_scaling)
                        count += 1
                    continue
                if name not in params:
                    raise KeyError(f"engine model has no parameter {name!r}")
                write(params[name], tensor)
                if name not in self._pristine:
                    self._overwritten.add(name)
                count += 1
        if pending:
            raise ValueError(f"LoRA update is missing lora_A or lora_B for {sorted(pending)}")
        return count

    def _merge_adapter(self, params, module: str, ab: dict[str, torch.Tensor], scaling: float) -> None:
        name = f"{module}.weight"
        if name not in params:
            raise KeyError(f"engine model has no parameter {name!r} for LoRA module {module!r}")
        w = params[name]
        if name not in self._pristine and name in self._overwritten:
            raise ValueError(
                f"{name} was replaced by a merged (full-weight) sync, so its pristine base is gone; adapter-only "
                "sync cannot follow merged sync on one server: keep one lora_sync mode per run"
            )
        base = self._pristine.setdefault(name, w.detach().clone())
        delta = (ab["lora_B"].float() @ ab["lora_A"].float()) * scaling
        w.copy_((base.float() + delta).to(w.dtype))

    def weight_checksums(self, metas) -> list[int]:
        """`verify.tensor_checksum` of each named parameter as the engine holds it now, in the sync's dtype (exact:
        the engine holds float32, which represents every 16- and 32-bit float the trainer sends)."""
        with torch.no_grad():
            return [tensor_checksum(self._params[m.name].to(m.dtype)) for m in metas]

    def finish_update(self, version: int | None = None) -> int:
        """A sync is complete: serve it as `version` (the trainer's; None keeps the version, as vLLM does) from a
        prefix cache emptied of keys and values computed with the old weights."""
        if version is not None:
            self.version = int(version)
        self.reset_prefix_cache()
        return self.version

    @abstractmethod
    def reset_prefix_cache(self) -> None:
        """Drop cached keys and values (each engine has its own cache: CPUEngine's prefix cache, SlotEngine's)."""
