"""Rank 0 leads, the other ranks follow: one channel for whatever only rank 0 can do but every rank may have to join.

Under several processes only rank 0 holds the server, the orchestrator and the sync. What it does in a step —
wait for a batch, sync the weights, evaluate, write the final model — can need every rank at moments only rank 0
knows: a sharded export (ZeRO-3, FSDP2) gathers on all ranks whenever its weight stream is walked, and a server that
died is replaced and synced again in the middle of a batch's generation or of a failed sync (serving/recovery.py).
So while rank 0 works the others wait on this channel for its commands: "stream" (walk the same weight stream: a
sharded stream opens with this command, `ShardedExport.stream`, so none starts without them), then "done" with
rank 0's result, or "failed" with its error, raised on every rank: a server lost for good stops and checkpoints
all ranks together instead of leaving them in a collective that rank 0 never joins.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from verifiers_rl.errors import ServerLost, TrainingError

T = TypeVar("T")


class RankZeroLeads:
    def __init__(self, export: Callable, waiting: Callable = contextlib.nullcontext):
        self.export = export  # () -> WeightExport: the training model's export, as a follower walks it
        self.waiting = waiting  # () -> a wait a signal may end (RLTrainer.abandonable)
        self.joined = False  # inside `run`: rank 0 leads, the others follow its commands

    @property
    def several(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def run(self, work: Callable[[], T], *, abandonable: bool = False) -> T:
        """`work()` on rank 0 while the other ranks follow its commands; every rank returns rank 0's result or
        raises its error. `abandonable`: the waits for rank 0 (and rank 0's answer) may be ended by a signal."""
        if not self.several:
            return work()
        self.joined = True
        try:
            if dist.get_rank() != 0:
                return self._follow(abandonable)
            try:
                value = work()
            except Exception as e:  # noqa: BLE001 - every rank stops with it (a signal's BaseException is per rank)
                self._send(("failed", type(e).__name__, str(e)))
                raise
        finally:
            self.joined = False
        with self.waiting() if abandonable else contextlib.nullcontext():
            self._send(("done", value))
        return value

    def open_stream(self, kind: str, bucket_bytes: int) -> None:
        """Every rank, inside `run`, opening a walk of a sharded weight stream (`ShardedExport.stream` checks it is
        inside): rank 0 tells the others to walk it too; they are walking it because they were told."""
        if dist.get_rank() == 0:
            self._send(("stream", kind, bucket_bytes))

    def _send(self, message: tuple) -> None:
        dist.broadcast_object_list([message], src=0)

    def _follow(self, abandonable: bool):
        while True:
            box = [None]
            with self.waiting() if abandonable else contextlib.nullcontext():
                dist.broadcast_object_list(box, src=0)
            op, *rest = box[0]
            if op == "stream":
                for _ in self.export().stream(*rest):  # outside the abandonable wait: rank 0 gathers with us
                    pass
            elif op == "done":
                return rest[0]
            else:
                name, text = rest
                if name == "ServerLost":  # the run stops as on rank 0: the last step checkpointed, on every rank
                    raise ServerLost(text)
                raise TrainingError(text if name == "TrainingError" else f"rank 0 failed: {name}: {text}")
