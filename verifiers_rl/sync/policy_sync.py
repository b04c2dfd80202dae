"""Policy sync: the one owner of which policy version the server serves, and of when weights must move.

Version v is the policy after v optimizer steps (the trainer's `global_step`); it becomes the server's version
(`PolicyVersion`) when a sync carrying it finishes. `PolicySync` advances it, and nothing else does; the
orchestrator reads it and can wait for it; the server only echoes it back per response (`policy_version`).
After each optimizer step (and before evaluating) the trainer asks `sync(version)`. The rule, in one place:

- the server already serves `version` (nothing trained since): nothing to do;
- the server was started from exactly the trainer's weights of `version` (`started_from`), or the last step
  trained nothing (`changed=False`): no transfer, the server's version is advanced to `version`;
- otherwise the weights move: the export's stream (merged or adapter, as the serving plan says) through the
  client's weight sender, which checks that every receiving rank loaded what was sent (sync/verify.py); a
  sync that did not land stops the run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from verifiers_rl.errors import TrainingError
from verifiers_rl.sync.buckets import DEFAULT_BUCKET_BYTES
from verifiers_rl.sync.export import WeightExport
from verifiers_rl.sync.verify import SyncMismatch


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


class PolicySync:
    def __init__(self, served: PolicyVersion | None = None):
        self.served = served or PolicyVersion()
        self.client = None  # InferenceClient with a weight sender (set by `attach`)
        self.weights = "merged"  # what a transfer sends: the serving plan's "merged" | "adapter"
        self.bucket_bytes = DEFAULT_BUCKET_BYTES  # the sender's bucket size; sharded exports gather about this much
        self.started_from: int | None = None  # the version whose weights the server was started from
        self.before_transfer: Callable[[int], None] = lambda version: None  # e.g. wait for older batches
        self.on_failure: Callable[[str], Exception] = RuntimeError

    def attach(self, client, weights: str, started_from: int | None) -> None:
        """A server to keep in sync: its client (sender initialised), what to send, and the version of the
        trainer's weights it was started from (None: unknown weights, e.g. a server someone else started)."""
        self.client, self.weights, self.started_from = client, weights, started_from
        self.served.forget()

    def detach(self) -> None:
        self.client, self.started_from = None, None
        self.served.forget()

    def needs_transfer(self, version: int, changed: bool = True) -> bool:
        """Whether making the server serve `version` moves weights (the rule; `sync` follows it)."""
        served = self.served.value
        if served == version:
            return False
        return not ((served is None and self.started_from == version) or (served is not None and not changed))

    def sync(self, export: WeightExport, version: int, changed: bool = True) -> float:
        """Make the server serve `version`; returns the seconds spent moving weights (0.0 when none moved).
        Under a sharded layout the other ranks walk the same stream meanwhile: its walk opens by telling them to
        (`ShardedExport.stream`), each transfer's, a replaced server's included."""
        if self.served.value == version:
            return 0.0
        if not self.needs_transfer(version, changed):
            return self._advance(version)
        self.before_transfer(version)
        stream = export.stream(self.weights, self.bucket_bytes)
        try:
            stats = self.client.update_weights(stream, version=version)
        except SyncMismatch as e:  # the server's checksums differ from the trainer's: one line, no log tail
            raise TrainingError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - httpx, gloo and server errors all end here, as one line
            if export.collective:
                stream.drain()  # the other ranks are inside the stream's gathers: let them finish
            raise self.on_failure(f"weight sync to version {version} failed: {type(e).__name__}: {e}") from None
        self.served.advance(version)
        return stats.seconds

    def _advance(self, version: int) -> float:
        """The server already holds the weights of `version`: tell it the version, move no byte (a server that
        just started serves version 0 by itself)."""
        if self.served.value is not None or version != 0:
            self.client.relabel(version, was=self.served.value)
        self.served.advance(version)
        return 0.0
