"""The policy version: which weights the inference server is serving, owned by the trainer.

Version v is the policy after v optimizer steps (the trainer's `global_step`); it becomes the server's version
when a sync carrying it finishes. `PolicySync` (policy_sync.py) advances it, and nothing else does; the
orchestrator reads it (to tag what a batch was generated with) and can wait for it (to start a batch only once
its policy is served). The server echoes it back per response (`policy_version`); nothing else counts versions.
"""

from __future__ import annotations

import threading


class PolicyVersion:
    def __init__(self, value: int | None = None):
        self._value = value
        self._cond = threading.Condition()

    @property
    def value(self) -> int | None:
        """The version the server serves; None while its weights are not known to be any version of this run
        (no sync yet, or a new server)."""
        with self._cond:
            return self._value

    def advance(self, value: int) -> None:
        """The server now serves `value` (after a sync, or the start of a resumed run)."""
        with self._cond:
            self._value = value
            self._cond.notify_all()

    def forget(self) -> None:
        """The server is gone: a next one serves whatever it is started from, not a known version."""
        with self._cond:
            self._value = None

    def reached(self, value: int) -> bool:
        with self._cond:
            return self._value is not None and self._value >= value

    def wait_for(self, value: int, timeout: float | None = None) -> bool:
        """Block until the served version is >= `value`; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._value is not None and self._value >= value, timeout)
