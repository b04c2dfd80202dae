"""Checkpoints of a model FSDP2-sharded at load time (sharding.py). Trainer saves its weights (transformers gathers
the shards) and its scheduler, RNG and state, but not its optimizer state: transformers refuses to checkpoint it
for such a model. Here the optimizer state is gathered whole onto rank 0 and saved as one file, and loaded back
into the shards from rank 0 (torch.distributed.checkpoint's full state dicts), so a resume is exact. A full
fine-tuning's weights load back the same way; a LoRA adapter is whole on every rank and Trainer loads it itself.
"""

from __future__ import annotations

import os

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

OPTIMIZER_FILE = "optimizer.pt"  # Trainer's name for it, so resume_point finds it as it finds a replicated one


def save_optimizer(model, optimizer, output_dir: str, is_main: bool) -> None:
    """Every rank: a collective gather of the optimizer state; rank 0 writes it."""
    state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_main:
        torch.save(state, os.path.join(output_dir, OPTIMIZER_FILE))


def load_optimizer(model, optimizer, checkpoint: str, is_main: bool) -> None:
    """Every rank: rank 0 reads the whole state, and each rank receives its shards of it."""
    state = (
        torch.load(os.path.join(checkpoint, OPTIMIZER_FILE), map_location="cpu", weights_only=True) if is_main else {}
    )
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=options)


def load_weights(model, checkpoint: str, is_main: bool) -> None:
    """Full fine-tuning: the checkpoint's whole weights, read on rank 0 and scattered into every rank's shards."""
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(checkpoint) if f.endswith(".safetensors") and not f.startswith("adapter"))
    state = {}
    if is_main:
        for name in files:
            state.update(load_file(os.path.join(checkpoint, name)))
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, state, options=options)


class FSDP2Checkpoints:
    """Trainer overrides for a run with `self.fsdp2` set: its optimizer state (and a full fine-tuning's weights)
    saved whole and loaded back into the shards; everything else is Trainer's own."""

    fsdp2 = False

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.fsdp2:
            return super()._save_optimizer_and_scheduler(output_dir)
        save_optimizer(self.model, self.optimizer, output_dir, self.args.should_save)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self.fsdp2 or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_optimizer(self.model, self.optimizer, checkpoint, self.args.process_index == 0)
        scheduler = torch.load(os.path.join(checkpoint, "scheduler.pt"), map_location="cpu", weights_only=True)
        self.lr_scheduler.load_state_dict(scheduler)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not self.fsdp2 or self.args.use_lora:  # a LoRA adapter is whole on every rank: Trainer loads it
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_weights(model if model is not None else self.model, resume_from_checkpoint, self.args.process_index == 0)
