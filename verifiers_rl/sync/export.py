"""Weight export: the training model turned into what the server and the loss need, whatever the parallel layout.

- the sync: `stream(kind, bucket_bytes)` is a `WeightStream` of the tensors the server loads ("merged": every weight
  with LoRA merged out of place; "adapter": LoRA A/B only). The plan (`policy_weights.merged_items` /
  `adapter_items`) comes from the model's structure; each layout only says how its parameters are spread over the
  ranks. The final model reads "merged" and "adapter_state" (the adapter as peft saves it) the same way.
- the loss: a replicated output projection is applied in chunks (`loss.forward`); a sharded one is reached inside
  the model's own forward (`head_in_forward`), whose hooks gather it and route its gradient back to the shards.

`weight_export(model, accelerator)` picks `ReplicatedExport` (one process, DDP, ZeRO-1/2), `ZeRO3Export` or
`FSDP2Export`. Under a sharded layout producing a tensor is a collective: every rank walks the stream in the same
order (`collective = True`), and each walk opens with rank 0 telling the others to (`ShardedExport.stream`). Only
rank 0 sends, so on the CPU a sync brings the pieces to rank 0 alone (shard_gather.py), a group of about
`bucket_bytes` at a time, the next group in flight while rank 0 sends this one; on an accelerator it takes the
libraries' gathers, group by group (`hand_gather` says why).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
import torch.distributed as dist

from verifiers_rl.sync.buckets import DEFAULT_BUCKET_BYTES, TensorMeta, consecutive
from verifiers_rl.sync.policy_weights import (
    ExportItem,
    adapter_items,
    full_shape,
    materialize,
    merged_items,
    replicated_stream,
    unit_scaling_config,
    unwrap_peft,
)
from verifiers_rl.sync.shard_gather import Pieces, Ring, ToRankZero, dim0_rows, flat_lengths
from verifiers_rl.sync.stream import WeightStream

# the reused receive buffers of each sharded model's syncs (rank 0), kept as long as the model
_RINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

KINDS = ("merged", "adapter", "adapter_state")


class WeightExport(Protocol):
    collective: bool  # producing the stream is a collective: every rank iterates it
    head_in_forward: bool  # the output projection is reached inside the model's forward (sharded head)

    def stream(self, kind: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> WeightStream: ...


def _items(model, kind: str, dtype: torch.dtype | None = None) -> tuple[list[ExportItem], dict | None, int]:
    if kind == "adapter":
        items, ranks = adapter_items(model)
        return items, unit_scaling_config(ranks), max(ranks.values())
    if kind == "merged":
        return merged_items(model, dtype), None, 0
    if kind == "adapter_state":  # what peft saves as the adapter, as the model holds it (the final export's)
        inner, peft_base = unwrap_peft(model)
        pre = "base_model.model." if peft_base is not None else ""
        params = [(pre + n, n, p) for n, p in inner.named_parameters() if is_adapter_weight(n)]
        return [ExportItem(k, TensorMeta(k, p.dtype, full_shape(p)), (n,), "copy") for k, n, p in params], None, 0
    raise ValueError(f"weight export kind={kind!r}; allowed: {', '.join(KINDS)}")


class ReplicatedExport:
    """Every rank holds the whole model (one process, DDP, ZeRO-1/2): tensors are read as they are."""

    collective = False
    head_in_forward = False

    def __init__(self, model, dtype: torch.dtype | None = None):
        self.model = model  # unwrapped: peft or transformers names, no DDP prefix
        self.dtype = dtype  # merged sync's transfer dtype (`weight_export`); None: each parameter's own

    def stream(self, kind: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> WeightStream:
        items, config, rank = _items(self.model, kind, self.dtype)
        return replicated_stream(self.model, items, config, rank)


class ShardedExport(ABC):
    """Parameters live in shards across ranks; `gathered(names)` makes a group of them whole on every rank."""

    collective = True
    head_in_forward = True

    def __init__(self, model, dtype: torch.dtype | None = None, leads=None):
        self.model, self.dtype = model, dtype
        self.leads = leads  # the RankZeroLeads whose `run` every rank joins (trainer/rank_zero.py); None: none
        self.inner, _ = unwrap_peft(model)
        self.params = dict(self.inner.named_parameters())
        # Which gather a sync uses: the hand path (shard_gather.py) only where a benchmark shows it faster, the CPU
        # over gloo: bench_gather.py, 2 CPU processes, ~100M parameters, merged stream, medians of 3: FSDP2 0.35 s
        # hand vs 3.19 s `full_tensor()` per parameter (9.1x), ZeRO-3 0.28 s vs 0.99 s `GatheredParameters` per
        # bucket (3.5x); ~10M: 4.7x and 4.3x (benchmarks/results/bench_gather*.json). On an accelerator (NCCL) it
        # was never measured, and the libraries' collectives are the ones their authors tune there. bench_gather.py
        # and test_shard_gather.py set it to run either path; bench_gather run on NCCL would move this line.
        self.hand_gather = all(p.device.type == "cpu" for p in self.params.values())

    @abstractmethod
    def gathered(self, names: list[str]) -> contextlib.AbstractContextManager[dict[str, torch.Tensor]]:
        """The named parameters whole, on every rank, for the duration of the context (ZeRO3Export, FSDP2Export)."""

    def stream(self, kind: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> WeightStream:
        """The every-rank rule. Every rank walks a sharded stream, and only rank 0 knows when one is due (a sync, a
        replaced server's, the final model): so each walk opens with rank 0 telling the others what to walk
        (`RankZeroLeads.open_stream`), which they hear only while they follow it, inside `RankZeroLeads.run`. A
        walk begun anywhere else, on any rank, is refused before it gathers anything: its gathers would wait
        forever for ranks that are not coming. Nothing is sent before the first tensor is asked for."""
        items, config, rank = _items(self.model, kind, self.dtype)

        def walk():
            several = dist.get_world_size() > 1
            if several and not getattr(self.leads, "joined", False):
                raise RuntimeError("a sharded weight sync outside RankZeroLeads.run: the other ranks cannot join it")
            if several:
                self.leads.open_stream(kind, bucket_bytes)
            yield from (self._produce_hand if self.hand_gather else self._produce_gathered)(items, bucket_bytes)

        return WeightStream([i.meta for i in items], walk, config, rank)

    @abstractmethod
    def pieces(self, p) -> Pieces | None:
        """How parameter `p` is spread over the ranks, in a layout the sync gathers point-to-point to rank 0
        (shard_gather.py); None for any other (whole on every rank, or a layout only `gathered` knows)."""

    def _produce_gathered(self, items: list[ExportItem], bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """The libraries' own gathers (`gathered`: GatheredParameters, `full_tensor()`), one bucket's parameters at
        a time on every rank; rank 0 computes the bucket's tensors inside the gather and yields them after it
        (they keep the gathered memory they need alive)."""
        source = dist.get_rank() == 0
        for group in _groups(items, bucket_bytes):
            with self.gathered(_sources(group)) as full:
                out = [(item.name, materialize(item, full)) for item in group] if source else []
            yield from out

    def _produce_hand(self, items: list[ExportItem], bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        # Rank 0 alone sends, so only it receives the whole tensors; the other ranks send their pieces and yield
        # nothing. Group k+1 travels while the sender handles group k. No copies: the tensors are views of the
        # ring's buffers (valid while the sender can read them, see Ring), fresh `full_tensor()` results, or
        # parameters that no optimizer step changes during a sync.
        groups = list(_groups(items, bucket_bytes))
        ring = _RINGS.get(self.inner)
        if ring is None or ring.slot_bytes < bucket_bytes:
            ring = _RINGS[self.inner] = Ring(bucket_bytes + (1 << 16))  # room for dtype alignment
        source = dist.get_rank() == 0
        pending = self._start(_sources(groups[0]), ring, 0) if groups else None
        for k, group in enumerate(groups):
            full = pending()
            pending = self._start(_sources(groups[k + 1]), ring, k + 1) if k + 1 < len(groups) else None
            if source:
                out = [(item.name, materialize(item, full)) for item in group]
                del full
                yield from out

    def _start(self, names: list[str], ring: Ring, index: int) -> Callable[[], dict[str, torch.Tensor]]:
        """Post a group's transfers (every rank, in the same order); the callable waits for them and gives
        {name: whole tensor} on rank 0. Parameters without `pieces` go through `gathered` first (a collective
        on every rank, as the layout does it), then travel as parameters whole on every rank."""
        pieces, others, group = {}, [], None
        for n in names:
            pc = self.pieces(self.params[n])
            if pc is not None and (pc.group is None or group is None or pc.group is group):
                pieces[n] = pc  # one process group per transfer (a second one, if any, takes `gathered`)
                group = group if pc.group is None else pc.group
            else:
                others.append(n)
        if others:
            # whole on every rank now; rank 0 copies them into the group's buffer with the rest, in order, so the
            # group still lies as its bucket (the gathered memory is kept alive by these references meanwhile)
            with self.gathered(others) as g:
                gathered = {n: Pieces.whole_here(g[n]) for n in others}
            pieces = {n: pieces.get(n) or gathered[n] for n in names}
        return ToRankZero(pieces, ring, index).wait


def is_adapter_weight(name: str) -> bool:
    """What peft saves as the adapter: the LoRA factors and the trained copies of `modules_to_save`."""
    return ".lora_" in name or ".modules_to_save." in name


def _sources(group: list[ExportItem]) -> list[str]:
    """The parameters a group of items is computed from, each once, in order."""
    return list(dict.fromkeys(s for item in group for s in item.sources))


def _groups(items: list[ExportItem], bucket_bytes: int) -> Iterator[list[ExportItem]]:
    return consecutive(items, lambda item: item.meta.nbytes, bucket_bytes)


class ZeRO3Export(ShardedExport):
    """DeepSpeed ZeRO-3: each rank holds a slice of every parameter (an empty tensor outside a gather)."""

    @contextlib.contextmanager
    def gathered(self, names):
        import deepspeed

        params = [self.params[n] for n in names]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield {n: p.data for n, p in zip(names, params)}

    def pieces(self, p) -> Pieces | None:
        """ZeRO-3's partition: the parameter flattened and padded to `world` equal slices, rank r holding slice r
        (`ds_tensor`). Persistent (small, kept whole), in-use, secondary (ZeRO++) and quantized partitions are
        left to `gathered`: reading a persistent parameter's whole `data` directly instead made the merged LoRA
        weights of tests/e2e/test_sharded.py differ from one process's by ~2 lr after 3 steps (GatheredParameters
        releases it on exit, so the next forward fetches it from its partition)."""
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        part = getattr(p, "ds_tensor", None)
        if part is None:
            return Pieces.whole_here(p.data)  # not ZeRO's: whole on every rank
        if getattr(p, "ds_persist", False) or p.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            return None
        if getattr(p, "ds_secondary_tensor", None) is not None or hasattr(part, "ds_quant_scale"):
            return None
        group = getattr(p, "ds_process_group", None) or dist.group.WORLD
        world, size = dist.get_world_size(group), getattr(part, "ds_numel", part.numel())
        if part.numel() != size or size * world < p.ds_numel or dist.get_global_rank(group, 0) != 0:
            return None
        lengths = flat_lengths(p.ds_numel, size, world)
        local = part.detach().reshape(-1)[: lengths[dist.get_rank(group)]]
        return Pieces(tuple(p.ds_shape), part.dtype, lengths, local, group)


class FSDP2Export(ShardedExport):
    """FSDP2: DTensor parameters, sharded on dim 0 (torch.chunk's rows) on a 1-D mesh, gathered to rank 0 for a
    sync; another DTensor layout takes `full_tensor()` (an all-gather each). Parameters added after sharding (a
    LoRA adapter on a model sharded at load time) stay whole on every rank and are read as they are."""

    @contextlib.contextmanager
    def gathered(self, names):
        from torch.distributed.tensor import DTensor

        full = {}
        for n in names:
            p = self.params[n].detach()
            full[n] = p.full_tensor() if isinstance(p, DTensor) else p
        yield full

    def pieces(self, p) -> Pieces | None:
        from torch.distributed.tensor import DTensor, Shard

        if not isinstance(p, DTensor):
            return Pieces.whole_here(p)  # added after sharding (a LoRA adapter): whole on every rank
        if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),) or p.ndim == 0:
            return None
        group, world, rank = p.device_mesh.get_group(), p.device_mesh.size(), p.device_mesh.get_local_rank()
        rows, local = dim0_rows(p.shape[0], world), p.to_local().detach()
        if tuple(local.shape) != (rows[rank], *p.shape[1:]) or dist.get_global_rank(group, 0) != 0:
            return None
        inner = math.prod(p.shape[1:])
        return Pieces(tuple(p.shape), p.dtype, [r * inner for r in rows], local.reshape(-1), group)


def parallel_layout(model) -> str:
    """'zero3', 'fsdp2' or 'replicated', from how the parameters are held (not from configs: a model is what it is)."""
    for p in model.parameters():
        if hasattr(p, "ds_shape"):
            return "zero3"
        if type(p.data).__name__ == "DTensor" or type(p).__name__ == "DTensor":
            return "fsdp2"
    return "replicated"


def weight_export(model, accelerator=None, leads=None) -> WeightExport:
    """The export for the model's parallel layout (`model` as the Trainer holds it; `accelerator` unwraps it;
    `leads`: the RankZeroLeads a sharded export's walks open through, ShardedExport.stream).
    Under bf16/fp16 mixed precision a merged sync sends the compute dtype: full fine-tuning keeps float32 master
    weights (models.training_kwargs), and the server serves what the forward computes with, at half the bytes."""
    unwrapped = accelerator.unwrap_model(model) if accelerator is not None else model
    dtype = _HALF.get(getattr(accelerator, "mixed_precision", None))
    sharded = {"zero3": ZeRO3Export, "fsdp2": FSDP2Export}.get(parallel_layout(unwrapped))
    return sharded(unwrapped, dtype, leads) if sharded else ReplicatedExport(unwrapped, dtype)


_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
