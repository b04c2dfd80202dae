"""NCCL weight transfers that cannot hang: each blocking step runs on a daemon thread that the caller's thread
watches. NCCL calls have no timeout, and no Python signal handler runs in a thread waiting in PyNccl's C code.

A sync (`Watchdog`): a sync whose peer is gone (a worker that raised in `load_weights`, or died) would hold the
trainer for good. So the caller's thread watches the server's requests of this sync (a failed one means the workers
stopped receiving), its `/health` (a dead engine may never answer the request), the deadline, and signals (their
handlers run here). On any of them the communicator is aborted (`ncclCommAbort` through vLLM's `destroy`), which
fails the stuck call, and the sync ends with one line naming its stage; recovery then treats it like any failed
sync (serving/recovery.py).

The init (`BoundedInit`): vLLM's `trainer_init` sends the server's init request on a side thread, opens the
trainer's endpoint (a TCP store rendezvous, then `ncclCommInitRank`, which waits for every rank) and only then reads
the request's answer: a worker that fails after it reached the store leaves the trainer in `ncclCommInitRank`
forever, while the error that says why is already in the answer. Here the same three stages run in turn, each
watched: the request's failure ends whichever stage is waiting, at once, with the server's error; a stage that
outlasts its bound ends the init with its name. A thread left in `ncclCommInitRank` cannot be cancelled: it stays
behind as a daemon, and the error stops the run. vLLM is imported lazily.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from verifiers_rl.errors import ServerError

logger = logging.getLogger(__name__)
T = TypeVar("T")

HEALTH_EVERY_S = 1.0  # how often the server's /health is asked while a transfer runs
HEALTH_MISSES = 2  # answers in a row that it is down before the transfer is aborted (one can be a hiccup)
POLL_S = 0.05  # how often the watching thread looks
JOIN_S = 5.0  # how long an aborted transfer's thread is given to return after the abort
STORE, COMMUNICATOR, REQUEST = "store rendezvous", "communicator creation", "server's init request"


class SyncAborted(ServerError):
    """A transfer the watchdog ended: its communicator is aborted and unusable."""


class Background:
    """`fn()` on a daemon thread (work that never returns must not keep the process alive at exit); `result()`
    waits for it and gives its value or raises its error."""

    def __init__(self, fn: Callable, name: str | None = None):
        self.value, self.error = None, None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self.thread.start()

    def _run(self, fn: Callable) -> None:
        try:
            self.value = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            self.error = e
        finally:
            self.done.set()

    @property
    def failed(self) -> bool:
        return self.done.is_set() and self.error is not None

    def result(self):
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


class Watchdog:
    def __init__(
        self,
        *,
        timeout_s: float,
        abort: Callable[[], None],
        stage: Callable[[], str],
        failure: Callable[[], BaseException | None] = lambda: None,
        healthy: Callable[[], bool] = lambda: True,
    ):
        self.timeout_s = timeout_s
        self.abort = abort  # makes the transfer's blocked call return (with an error)
        self.stage = stage  # where the transfer is, in words, for the error
        self.failure = failure  # the first request of the transfer that failed, if any
        self.healthy = healthy  # the server's /health; False: it cannot receive

    def run(self, work: Callable[[], T], what: str) -> T:
        start = time.monotonic()
        thread = Background(work, f"vf-{what}")
        next_health, misses = start + HEALTH_EVERY_S, 0
        try:
            while not thread.done.wait(POLL_S):
                if (failed := self.failure()) is not None:
                    self._abort(what, thread, f"the server failed: {type(failed).__name__}: {failed}")
                now = time.monotonic()
                if now >= next_health:
                    misses = 0 if self.healthy() else misses + 1
                    next_health = time.monotonic() + HEALTH_EVERY_S
                    if misses >= HEALTH_MISSES:
                        self._abort(what, thread, "the server stopped answering /health")
                if now - start > self.timeout_s:
                    self._abort(what, thread, f"it did not finish within {self.timeout_s:g}s")
        except SyncAborted:
            raise
        except BaseException:  # a signal's exception, raised in this thread by its handler: end the transfer too
            self._stop(thread)
            raise
        return thread.result()

    def _abort(self, what: str, thread: Background, why: str):
        stage = self.stage()  # read before the abort moves the transfer on
        self._stop(thread)
        raise SyncAborted(f"{what} aborted {stage}: {why}; its communicator was aborted")

    def _stop(self, thread: Background) -> None:
        try:
            self.abort()
        except Exception as e:  # noqa: BLE001 - the cause the caller raises says more
            logger.warning("aborting the weight transfer's communicator failed: %s", e)
        if not thread.done.wait(JOIN_S):  # NCCL did not give the call back: leave the daemon thread, the run ends
            logger.warning(
                "the aborted weight transfer's thread %s did not return; it is left behind", thread.thread.name
            )


class BoundedInit:
    def __init__(self, control, timeout_s: float):
        self.control = control  # SyncControl: the server's /init_weight_transfer_engine
        self.timeout_s = timeout_s  # each stage's bound

    def open(self, info):
        """vLLM's trainer_init for the sender (NCCL rank 0; the server's workers take ranks 1..n): returns the
        communicator, after the server confirmed its workers' side."""
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

        # the dense engine's wire params (the sparse engine's info has none: the workers keep their defaults)
        wire = ("packed", "packed_buffer_size_bytes", "packed_num_buffers")
        workers = NCCLWeightTransferInitInfo(
            master_address=info.master_address,
            master_port=info.master_port,
            rank_offset=1,
            world_size=info.world_size,
            **{k: getattr(info, k) for k in wire if hasattr(info, k)},
        )
        payload = worker_init_payload(workers)
        request = Background(lambda: self.control.init_weight_transfer_engine(payload), "nccl-init-request")
        store = Background(lambda: self._rendezvous(info), "nccl-init-store")
        where = f"no worker of the server connected to the trainer's store at {info.master_address}:{info.master_port}"
        group = self._wait(STORE, store, request, where)
        device = torch.accelerator.current_device_index()  # here: a new thread's current CUDA device is 0
        comm = Background(lambda: _communicator(group, device), "nccl-init-communicator")
        hint = "the server's workers reached the store but did not join the NCCL communicator: see the server's log"
        communicator = self._wait(COMMUNICATOR, comm, request, hint)
        if getattr(communicator, "disabled", False):
            # vLLM's communicator turns itself into a no-op when it cannot load libnccl: every sync would "succeed"
            # and move nothing. Said before waiting for the server, whose workers wait for this rank in vain.
            raise RuntimeError("vLLM could not load the NCCL library in the trainer process; use the gloo backend")
        self._wait(REQUEST, request, None, "the communicator is up, the server did not confirm its workers' side")
        return communicator

    def _rendezvous(self, info):
        from vllm.distributed.utils import StatelessProcessGroup

        # the store gives up on its own after the same bound: an abandoned wait does not hold the port for long
        return StatelessProcessGroup.create(
            host=info.master_address,
            port=info.master_port,
            rank=0,
            world_size=info.world_size,
            store_timeout=math.ceil(self.timeout_s),
        )

    def _wait(self, stage: str, work: Background, request: Background | None, hint: str):
        deadline = time.monotonic() + self.timeout_s
        while not work.done.wait(POLL_S):
            if request is not None and request.failed:  # the workers gave up: nothing will join this stage
                raise ServerError(
                    f"NCCL weight-transfer init: the server's init request failed while the trainer waited for the "
                    f"{stage}: {type(request.error).__name__}: {request.error}"
                )
            if time.monotonic() > deadline:
                raise ServerError(
                    f"NCCL weight-transfer init: the {stage} did not finish within {self.timeout_s:g}s ({hint})"
                )
        if work.error is not None:
            cause = work.error
            if request is not None and request.failed:  # the server's answer says more than a broken store
                cause = request.error
            raise ServerError(
                f"NCCL weight-transfer init failed during the {stage}: {type(cause).__name__}: {cause}"
            ) from cause
        return work.value


def _communicator(group, device: int):
    """vLLM's stateless_init_process_group after its store: the communicator on the trainer's CUDA device."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.utils.nccl import unpinned_nccl_env

    with unpinned_nccl_env():
        return PyNcclCommunicator(group, device=device)
