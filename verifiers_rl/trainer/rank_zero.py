"""Rank 0 leads, the other ranks follow: one channel for whatever only rank 0 can do but every rank may have to join.

Under several processes only rank 0 holds the server, the orchestrator and the sync. What it does in a step —
wait for a batch, sync the weights, evaluate — can need every rank at moments only rank 0 knows: a sharded export
(ZeRO-3, FSDP2) gathers on all ranks whenever a sync moves weights, and a server that died is replaced and synced
again in the middle of a batch's generation or of a failed sync (serving/recovery.py). So while rank 0 works the others
wait on this channel for its commands: "gather" (iterate the same weight stream, as often as rank 0 says), then
"done" with rank 0's result, or "failed" with its error, raised on every rank: a server lost for good stops and
checkpoints all ranks together instead of leaving them in a collective that rank 0 never joins.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

from accelerate.utils import broadcast_object_list

from verifiers_rl.errors import ServerLost, TrainingError

T = TypeVar("T")


class RankZeroLeads:
    def __init__(self, accelerator, export: Callable, waiting: Callable[[], contextlib.AbstractContextManager]):
        self.accelerator = accelerator
        self.export = export  # () -> WeightExport: the training model's export, as a follower iterates it
        self.waiting = waiting  # a wait a signal may end (RLTrainer.abandonable)
        self.leading = False

    @property
    def several(self) -> bool:
        return self.accelerator.num_processes > 1

    def run(self, work: Callable[[], T], *, abandonable: bool = False) -> T:
        """`work()` on rank 0 while the other ranks follow its commands; every rank returns rank 0's result or
        raises its error. `abandonable`: the waits for rank 0 (and rank 0's answer) may be ended by a signal."""
        if not self.several:
            return work()
        if self.accelerator.process_index != 0:
            return self._follow(abandonable)
        self.leading = True
        try:
            value = work()
        except Exception as e:  # noqa: BLE001 - every rank stops with it (a signal's BaseException is per rank)
            self._send(("failed", type(e).__name__, str(e)))
            raise
        finally:
            self.leading = False
        with self.waiting() if abandonable else contextlib.nullcontext():
            self._send(("done", value))
        return value

    def gather(self, kind: str, bucket_bytes: int) -> None:
        """Rank 0, about to iterate a collective weight stream: every other rank iterates the same one."""
        if not self.several:
            return
        if not self.leading:  # the other ranks are not listening: the gathers would wait forever
            raise RuntimeError("a sharded weight sync outside RankZeroLeads.run: the other ranks cannot join it")
        self._send(("gather", kind, bucket_bytes))

    def _send(self, message: tuple) -> None:
        broadcast_object_list([message], from_process=0)

    def _follow(self, abandonable: bool):
        while True:
            box = [None]
            with self.waiting() if abandonable else contextlib.nullcontext():
                broadcast_object_list(box, from_process=0)
            op, *rest = box[0]
            if op == "gather":
                self.export().stream(*rest).drain()  # outside the abandonable wait: rank 0 gathers with us
            elif op == "done":
                return rest[0]
            else:
                name, text = rest
                if name == "ServerLost":  # the run stops as on rank 0: the last step checkpointed, on every rank
                    raise ServerLost(text)
                raise TrainingError(text if name == "TrainingError" else f"rank 0 failed: {name}: {text}")
