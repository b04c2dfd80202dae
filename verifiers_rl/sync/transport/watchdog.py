"""A weight transfer that cannot hang: its blocking part runs on a daemon thread that the caller's thread watches.

NCCL calls have no timeout, and no Python signal handler runs in a thread waiting in PyNccl's C code, so a sync
whose peer is gone (a worker that raised in `load_weights`, or died) would hold the trainer for good. So the
caller's thread watches the server's requests of this sync (a failed one means the workers stopped receiving), its
`/health` (a dead engine may never answer the request), the deadline, and signals (their handlers run here). On
any of them the communicator is aborted (`ncclCommAbort` through vLLM's `destroy`), which fails the stuck call, and
the sync ends with one line naming its stage; recovery then treats it like any failed sync (serving/recovery.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from verifiers_rl.errors import ServerError

logger = logging.getLogger(__name__)
T = TypeVar("T")

HEALTH_EVERY_S = 1.0  # how often the server's /health is asked while a transfer runs
HEALTH_MISSES = 2  # answers in a row that it is down before the transfer is aborted (one can be a hiccup)
POLL_S = 0.05  # how often the watching thread looks
JOIN_S = 5.0  # how long an aborted transfer's thread is given to return after the abort


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
