"""Weight export: the training model turned into what the server and the loss need, whatever the parallel layout.

Two consumers read the model's weights, and both go through here:

- the sync: `stream(kind)` is a `WeightStream` of the tensors the server loads (`kind` "merged": every weight
  with LoRA merged; "adapter": LoRA A/B only), described up front and produced bucket by bucket. Under a sharded
  layout producing a tensor is a collective (a gather), so every rank iterates the stream and rank 0 sends it.
- the loss: `head_logprobs` scores hidden states through the output projection (`logprobs.chunked_logprobs`),
  which a sharded layout must gather first.

One implementation per parallel layout, chosen by `weight_export(model, accelerator)`: `ReplicatedExport`
(one process, or DDP: every rank holds the whole model).
"""

from __future__ import annotations

from typing import Protocol

import torch

from verifiers_rl.rl.inference.transfer.policy_weights import adapter_weights, merged_stream
from verifiers_rl.rl.inference.transfer.stream import WeightStream
from verifiers_rl.rl.trainer.logprobs import chunked_logprobs

KINDS = ("merged", "adapter")


class WeightExport(Protocol):
    def stream(self, kind: str) -> WeightStream: ...

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


class ReplicatedExport:
    """Every rank holds the whole model (one process, or DDP): tensors are read as they are."""

    def __init__(self, model):
        self.model = model  # unwrapped: peft or transformers names, no DDP prefix

    def stream(self, kind: str) -> WeightStream:
        if kind == "adapter":
            return adapter_weights(self.model).stream()
        if kind == "merged":
            return merged_stream(self.model)
        raise ValueError(f"weight export kind={kind!r}; allowed: {', '.join(KINDS)}")

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


def weight_export(model, accelerator=None) -> WeightExport:
    """The export for the model's parallel layout (`model` as the Trainer holds it; `accelerator` unwraps it)."""
    unwrapped = accelerator.unwrap_model(model) if accelerator is not None else model
    return ReplicatedExport(unwrapped)
