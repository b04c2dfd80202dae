"""What the rollouts are doing right now: which stage (setup, generation, env_response, scoring), in which
function, since when.

A rollout batch that does not finish is blamed on the stage it is stuck in: a reward function that never returns
is not the inference server's fault, and the message says so and names the function. The orchestrator's client
marks model requests (generation); wrappers installed on the environment (`watch_environment`) mark
`setup_state`, `env_response` and every weighted reward function (reward_checks.py). Entering and leaving a stage
costs a dict insert and delete under a lock, once per call.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import time
from dataclasses import dataclass

ATTRIBUTE = "_vf_rl_stages"
_WATCHED = "__vf_rl_watched__"
SERVER = "the inference server"  # what generation waits on


@dataclass(frozen=True)
class Activity:
    stage: str  # "setup" | "generation" | "env_response" | "scoring"
    name: str  # the function (or, for generation, the inference server)
    calls: int  # calls of it in flight
    oldest_s: float  # how long the oldest of them has run

    def describe(self) -> str:
        if self.stage == "generation":
            return f"{self.calls} request(s) to {SERVER} waiting up to {self.oldest_s:.0f}s"
        return f"{self.name} running for {self.oldest_s:.0f}s ({self.calls} call(s))"


class Stages:
    def __init__(self):
        self._active: dict[int, tuple[str, str, float]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def track(self, stage: str, name: str):
        key = next(self._ids)
        with self._lock:
            self._active[key] = (stage, name, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._active.pop(key, None)

    def entries(self) -> list[tuple[str, str, float]]:
        """(stage, function, monotonic start) of each call in flight: what a rollout process sends its trainer."""
        with self._lock:
            return list(self._active.values())

    def mirror(self, entries: list[tuple[str, str, float]]) -> None:
        """Show another process's calls in flight (its `entries()`): time.monotonic is one clock for every process
        of a machine, so their ages read right here."""
        with self._lock:
            self._active = dict(enumerate(entries))

    def snapshot(self) -> list[Activity]:
        """What is in flight, grouped by (stage, function), the longest-running first."""
        now = time.monotonic()
        with self._lock:
            entries = list(self._active.values())
        groups: dict[tuple[str, str], list[float]] = {}
        for stage, name, since in entries:
            groups.setdefault((stage, name), []).append(now - since)
        acts = [Activity(stage, name, len(ages), max(ages)) for (stage, name), ages in groups.items()]
        return sorted(acts, key=lambda a: -a.oldest_s)

    def overdue(self, stage: str, limit: float) -> Activity | None:
        return next((a for a in self.snapshot() if a.stage == stage and a.oldest_s > limit), None)

    def waiting_on_server(self) -> int:
        return sum(a.calls for a in self.snapshot() if a.stage == "generation")


def stages_of(env) -> Stages:
    """The environment's tracker (one per environment object, made on first use)."""
    stages = getattr(env, ATTRIBUTE, None)
    if stages is None:
        stages = Stages()
        setattr(env, ATTRIBUTE, stages)
    return stages


def stuck_message(stages: Stages, culprit: Activity | None = None) -> tuple[str | None, str]:
    """(the stage a batch is stuck in, a phrase naming it and the function) from what is in flight now: `culprit`
    first when a timeout already names it (a reward function past scoring_timeout, while requests that started a
    moment earlier are still answered), else the longest-running activity."""
    acts = stages.snapshot()
    if culprit is not None:
        acts = [culprit] + [a for a in acts if (a.stage, a.name) != (culprit.stage, culprit.name)]
    if not acts:
        return None, "nothing was in flight (stuck in the environment's own code between stages)"
    first = acts[0]
    rest = "; also " + ", ".join(a.describe() for a in acts[1:4]) if len(acts) > 1 else ""
    where = f"stuck in {first.stage}: {first.describe()}{rest}"
    if first.stage != "generation" and not stages.waiting_on_server():
        where += f"; no request is waiting on {SERVER}: the environment is stuck, not the server"
    return first.stage, where


def watch_environment(env) -> Stages:
    """Mark the environment's `setup_state` and `env_response` calls (idempotent). Instance attributes shadow
    the class's methods, which is how verifiers calls them (`self.env_response(...)`)."""
    stages = stages_of(env)
    for target in (env, *(getattr(env, "envs", None) or [])):
        for method, stage in (("setup_state", "setup"), ("env_response", "env_response")):
            func = getattr(target, method, None)
            if func is None or getattr(func, _WATCHED, False):
                continue
            setattr(target, method, _tracked(func, stages, stage, f"{type(target).__name__}.{method}"))
    return stages


def _tracked(func, stages: Stages, stage: str, name: str):
    @functools.wraps(func)
    async def tracked(*args, **kwargs):
        with stages.track(stage, name):
            result = func(*args, **kwargs)
            if hasattr(result, "__await__"):
                result = await result
            return result

    setattr(tracked, _WATCHED, True)
    return tracked
