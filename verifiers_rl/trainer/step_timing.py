"""A step's wall time split into stages, and the framework's share of it: what is left once the wait for rollouts,
forward/backward, the optimizer, the weight sync (and a checkpoint or evaluation the schedule asked for) are taken
out: batching, bookkeeping, logging, callbacks, HTTP outside generation.

Wall time runs from one log point (a step's metrics merged into its log line) to the next, so every second of the
run after the first step begins lands in exactly one step, the loop's own work between steps included. Stages are
perf_counter spans around calls the trainer already makes; none adds a synchronisation on the hot path. On CUDA an
unsynchronised timer charges queued GPU work to whatever synchronises next: forward/backward ends synchronised
already (its metrics are read to the host), and the optimizer span ends with one `torch.cuda.synchronize` — the
weight sync right after it reads the same parameters, so that wait moves from the sync's span into the optimizer's
and costs nothing overall.

Generation overlapped with training (max_async_level >= 1) is not on the step's critical path: only the time the
trainer blocked on rollouts is a stage (`rollouts_wait`); the hidden part is reported beside it, not subtracted.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Mapping

from transformers import TrainerCallback


def decompose(wall_s: float, stages: Mapping[str, float], generation_s: float = 0.0) -> dict[str, float]:
    """`timing/<stage>_s` for each stage, the step's `timing/wall_s`, the remainder `timing/framework_s` (never
    negative) and its share `timing/framework_frac`, and `timing/generation_overlapped_s`: generation that ran
    while the trainer did something else (`generation_s` less the wait for it), which is not part of the sum."""
    spans = {k: max(float(v), 0.0) for k, v in stages.items()}
    wall = max(float(wall_s), 0.0)
    framework = max(wall - sum(spans.values()), 0.0)
    out = {f"timing/{k}_s": v for k, v in spans.items()}
    out["timing/wall_s"] = wall
    out["timing/framework_s"] = framework
    out["timing/framework_frac"] = framework / wall if wall > 0 else 0.0
    out["timing/generation_overlapped_s"] = max(float(generation_s) - spans.get("rollouts_wait", 0.0), 0.0)
    return out


class StepClock:
    """Stage seconds accumulated between two log points (`lap`). Spans may be opened in one callback and closed in
    another (`open` / `close`); a span closed without being opened counts nothing."""

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self.now = now
        self._since: float | None = None
        self._spans: dict[str, float] = defaultdict(float)
        self._open: dict[str, float] = {}

    def start(self) -> None:
        """The first step begins (later calls keep the running lap)."""
        if self._since is None:
            self._since = self.now()

    def add(self, stage: str, seconds: float) -> None:
        self._spans[stage] += seconds

    @contextlib.contextmanager
    def span(self, stage: str):
        t0 = self.now()
        try:
            yield
        finally:
            self.add(stage, self.now() - t0)

    def open(self, stage: str) -> None:
        self._open[stage] = self.now()

    def close(self, stage: str) -> None:
        t0 = self._open.pop(stage, None)
        if t0 is not None:
            self.add(stage, self.now() - t0)

    def lap(self) -> tuple[float, dict[str, float]]:
        """(wall seconds since the last lap or the start, stage seconds in it); the next lap starts now."""
        now = self.now()
        wall = now - self._since if self._since is not None else 0.0
        spans, self._spans, self._since = dict(self._spans), defaultdict(float), now
        return wall, spans


class TimeOptimizer(TrainerCallback):
    """The optimizer span: from the end of `training_step` (the trainer opens it) to after `optimizer.step()`,
    gradient clipping included."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        import torch

        if getattr(self.trainer.accelerator.device, "type", "cpu") == "cuda":
            torch.cuda.synchronize()  # see the module docstring: the weight sync would wait for the same kernels
        self.trainer.clock.close("optimizer")
