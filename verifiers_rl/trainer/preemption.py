"""SIGTERM (what schedulers send before they kill a job) and Ctrl-C end a run without losing the last step.

First signal: a step that is computing finishes (its cost is bounded); a step still waiting for rollouts is
abandoned (nothing of it has touched the weights), and so is the weight sync after a step in a one-process run (the
step is trained; only the server, which is stopped anyway, would have received it). Then the last completed step is
checkpointed — in-flight rollout batches are kept if they finish within `save_on_signal_timeout`, else regenerated
on resume — the server is stopped, and the run ends with 143 (SIGTERM) or KeyboardInterrupt (130 from the CLIs).
A second signal exits at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

from transformers import TrainerCallback

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StepAbandoned(BaseException):
    """Raised inside a step that was waiting for rollouts when the signal came (BaseException: no
    `except Exception` in between may swallow it)."""


class PreemptionGuard:
    """Installs the handlers for the duration of `train()` (main thread only; elsewhere signals stay as they are)."""

    def __init__(self, on_second_signal=None):
        self.signum: int | None = None
        self.waiting = False  # the trainer is blocked on a wait the weights do not depend on: safe to abandon
        self.on_second_signal = on_second_signal
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame):
        if self.signum is not None:  # second signal: no more waiting
            if self.on_second_signal is not None:
                with contextlib.suppress(Exception):
                    self.on_second_signal()
            os._exit(128 + signum)
        self.signum = signum
        if self.waiting:
            raise StepAbandoned(signum)

    @contextlib.contextmanager
    def abandonable(self):
        """A wait that nothing of the weights depends on (rollouts, the server's start, the first sync): the
        first signal ends it at once."""
        self.waiting = True
        try:
            if self.signum is not None:  # the signal came between steps
                raise StepAbandoned(self.signum)
            yield
        finally:
            self.waiting = False

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def raise_for_signal(self) -> None:
        """After the checkpoint: end the run as the signal asked."""
        if self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signum is not None:
            raise SystemExit(128 + self.signum)


class StopOnSignal(TrainerCallback):
    """A step that finished after the signal: save it and stop the loop (the Trainer saves before it stops)."""

    def __init__(self, guard_of):
        self.guard_of = guard_of  # () -> the active PreemptionGuard or None

    def on_step_end(self, args, state, control, **kwargs):
        guard = self.guard_of()
        if guard is not None and guard.signum is not None:
            control.should_save = True
            control.should_training_stop = True
