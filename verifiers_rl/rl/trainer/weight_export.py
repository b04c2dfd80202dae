"""Weight export: the training model turned into what the server and the loss need, whatever the parallel layout.

Two consumers read the model's weights, and both go through here:

- the sync: `stream(kind, bucket_bytes)` is a `WeightStream` of the tensors the server loads ("merged": every weight
  with LoRA merged out of place; "adapter": LoRA A/B only), described up front and produced in order. The plan
  of a sync (`policy_weights.merged_items` / `adapter_items`) comes from the model's structure; each layout only
  says how a group of parameters becomes whole on this rank.
- the loss: the output projection. A replicated head is applied to the trained positions' hidden states in
  chunks (`head_logprobs`); a sharded one is reached inside the model's own forward (`head_in_forward`), whose
  hooks gather it and route its gradient back to the shards.

`weight_export(model, accelerator)` picks the implementation:

- `ReplicatedExport`: one process, DDP, ZeRO-1/2 (every rank holds every parameter).
- `ZeRO3Export`: DeepSpeed ZeRO-3 (`deepspeed.zero.GatheredParameters` on a group at a time).
- `FSDP2Export`: FSDP2's DTensor parameters (`full_tensor()`, a collective per parameter).

Under a sharded layout producing a tensor is a collective: every rank iterates the stream in the same order
(`collective = True`) and rank 0 sends it. Parameters are gathered a group of about `bucket_bytes` at a time, so
no rank ever holds more than about one bucket beyond its shard.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Protocol

import torch

from verifiers_rl.rl.inference.transfer.buckets import DEFAULT_BUCKET_BYTES
from verifiers_rl.rl.inference.transfer.policy_weights import (
    ExportItem,
    adapter_items,
    materialize,
    merged_items,
    replicated_stream,
    unit_scaling_config,
    unwrap_peft,
)
from verifiers_rl.rl.inference.transfer.stream import WeightStream
from verifiers_rl.rl.trainer.logprobs import chunked_logprobs

KINDS = ("merged", "adapter")


class WeightExport(Protocol):
    collective: bool  # producing the stream is a collective: every rank iterates it
    head_in_forward: bool  # the output projection is reached inside the model's forward (sharded head)

    def stream(self, kind: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> WeightStream: ...

    def head_logprobs(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        *,
        temperature: float,
        with_entropy: bool = True,
        chunk_size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def output_head(model) -> torch.nn.Module:
    head = model.get_output_embeddings()
    # peft `modules_to_save` wraps the head; the trained copy is the active one
    if hasattr(head, "modules_to_save") and hasattr(head, "active_adapter"):
        active = head.active_adapter
        head = head.modules_to_save[active[0] if isinstance(active, (list, tuple)) else active]
    return head


def _items(model, kind: str) -> tuple[list[ExportItem], dict | None, int]:
    if kind == "adapter":
        items, ranks = adapter_items(model)
        return items, unit_scaling_config(ranks), max(ranks.values())
    if kind == "merged":
        return merged_items(model), None, 0
    raise ValueError(f"weight export kind={kind!r}; allowed: {', '.join(KINDS)}")


class ReplicatedExport:
    """Every rank holds the whole model (one process, DDP, ZeRO-1/2): tensors are read as they are."""

    collective = False
    head_in_forward = False

    def __init__(self, model):
        self.model = model  # unwrapped: peft or transformers names, no DDP prefix

    def stream(self, kind: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> WeightStream:
        items, config, rank = _items(self.model, kind)
        return replicated_stream(self.model, items, config, rank)

    def lora_state(self) -> dict[str, torch.Tensor]:
        """The LoRA weights as peft names them in the model's state dict, whole, on the CPU (for a saved adapter)."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items() if is_adapter_weight(k)}

    def head_logprobs(self, hidden, targets, *, temperature, with_entropy=True, chunk_size=None):
        head = output_head(self.model)
        return chunked_logprobs(
            hidden,
            head.weight,
            targets,
            bias=getattr(head, "bias", None),
            temperature=temperature,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
        )


class ShardedExport(ABC):
    """Parameters live in shards across ranks; `gathered(names)` makes a group of them whole on every rank."""

    collective = True
    head_in_forward = True

    def __init__(self, model):
        self.model = model
        self.inner, _ = unwrap_peft(model)
        self.params = dict(self.inner.named_parameters())

    @abstractmethod
    def gathered(self, names: list[str]) -> contextlib.AbstractContextManager[dict[str, torch.Tensor]]:
        """The named parameters whole, on every rank, for the duration of the context (ZeRO3Export, FSDP2Export)."""

    def stream(self, kind: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> WeightStream:
        items, config, rank = _items(self.model, kind)
        return WeightStream([i.meta for i in items], lambda: self._produce(items, bucket_bytes), config, rank)

    def _produce(self, items: list[ExportItem], bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        for group in _groups(items, bucket_bytes):
            names = list(dict.fromkeys(s for item in group for s in item.sources))
            with self.gathered(names) as full:
                # copies: the gathered storage is released when the group's context closes, and a sender may
                # still be broadcasting the previous tensor from its own memory
                out = [(item.name, materialize(item, full).clone()) for item in group]
            yield from out

    def lora_state(self) -> dict[str, torch.Tensor]:
        """As `ReplicatedExport.lora_state`; every rank gathers, each gets the whole adapter (it is small)."""
        prefix = "base_model.model." if self.inner is not self.model else ""
        names = [n for n in self.params if is_adapter_weight(n)]
        with self.gathered(names) as full:
            return {prefix + n: full[n].detach().cpu().clone() for n in names}

    def head_logprobs(self, hidden, targets, *, temperature, with_entropy=True, chunk_size=None):
        raise RuntimeError("a sharded output head is reached inside the model's forward (head_in_forward)")


def is_adapter_weight(name: str) -> bool:
    """What peft saves as the adapter: the LoRA factors and the trained copies of `modules_to_save`."""
    return ".lora_" in name or ".modules_to_save." in name


def _groups(items: list[ExportItem], bucket_bytes: int) -> Iterator[list[ExportItem]]:
    """Consecutive items whose tensors add up to about one bucket (a larger item makes a group of its own)."""
    group, size = [], 0
    for item in items:
        if group and size + item.meta.nbytes > bucket_bytes:
            yield group
            group, size = [], 0
        group.append(item)
        size += item.meta.nbytes
    if group:
        yield group


class ZeRO3Export(ShardedExport):
    """DeepSpeed ZeRO-3: each rank holds a slice of every parameter (an empty tensor outside a gather)."""

    @contextlib.contextmanager
    def gathered(self, names):
        import deepspeed

        params = [self.params[n] for n in names]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield {n: p.data for n, p in zip(names, params)}


class FSDP2Export(ShardedExport):
    """FSDP2: DTensor parameters sharded on dim 0; `full_tensor()` all-gathers one. Parameters added after sharding
    (a LoRA adapter on a model sharded at load time) stay whole on every rank and are read as they are."""

    @contextlib.contextmanager
    def gathered(self, names):
        from torch.distributed.tensor import DTensor

        full = {}
        for n in names:
            p = self.params[n].detach()
            full[n] = p.full_tensor() if isinstance(p, DTensor) else p
        yield full


def parallel_layout(model) -> str:
    """'zero3', 'fsdp2' or 'replicated', from how the parameters are held (not from configs: a model is what it is)."""
    for p in model.parameters():
        if hasattr(p, "ds_shape"):
            return "zero3"
        if type(p.data).__name__ == "DTensor" or type(p).__name__ == "DTensor":
            return "fsdp2"
    return "replicated"


def weight_export(model, accelerator=None) -> WeightExport:
    """The export for the model's parallel layout (`model` as the Trainer holds it; `accelerator` unwraps it)."""
    unwrapped = accelerator.unwrap_model(model) if accelerator is not None else model
    layout = parallel_layout(unwrapped)
    if layout == "zero3":
        return ZeRO3Export(unwrapped)
    if layout == "fsdp2":
        return FSDP2Export(unwrapped)
    return ReplicatedExport(unwrapped)
