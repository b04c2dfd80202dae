"""The guard every sync backend gets: at `max_async_level = 0` the sampler and the trainer hold the same weights,
so `mismatch_kl` (k3 KL(sampler ‖ trainer) at the trained tokens) is numerical noise (~1e-14 in float32, ~1e-3
with bf16 GPU kernels), and a sync that did not land, or landed wrong, shows as a jump in the first batch sampled
after it. It catches what checksums (sync/verify.py) cannot: wrong bytes both sides agree on (a wrongly gathered
shard), and backends that report nothing (vLLM's NCCL engines).

The rule (docs/training.md says why): a step stops the run when its mismatch_kl is above
`max(mismatch_kl_floor, mismatch_kl_guard x baseline)`, the baseline being the median of earlier steps' values.
A passing step joins the baseline only within sqrt(mismatch_kl_guard) x baseline, so that a server drifting a
little more at every step cannot carry the baseline up with it; the first step always joins. With
`max_async_level >= 1` the sampler is legitimately older and the guard is off.
"""

from __future__ import annotations

import math
import statistics

WINDOW = 64  # the baseline is the median of this many earlier steps' values: a few spikes do not move it


class MismatchGuard:
    def __init__(self, ratio: float, floor: float, window: int = WINDOW):
        self.ratio, self.floor, self.window = ratio, floor, window
        self.history: list[float] = []

    @property
    def baseline(self) -> float:
        return statistics.median(self.history) if self.history else self.floor

    def limit(self) -> float:
        return max(self.floor, self.ratio * self.baseline)

    def check(
        self, step: int, mismatch_kl: float | None, version: int, trained: bool = True, served: int | None = None
    ) -> str | None:
        """The one-line reason to stop at `step`, whose batch was sampled right after the sync to `version` (by the
        server's word, with the weights of `served`); None when the step is in line with the run."""
        if self.ratio <= 0 or mismatch_kl is None or not trained:
            return None
        limit = self.limit()
        if mismatch_kl > limit:
            said = f" (its rollouts say version {served})" if served is not None and served != version else ""
            return (
                f"step {step}: mismatch_kl {mismatch_kl:.3g} right after the sync to version {version}{said} is above "
                f"{limit:.3g} ({self.ratio:g} x this run's baseline {self.baseline:.3g}, at least "
                f"mismatch_kl_floor {self.floor:g}): the server samples from other weights than the trainer's, so "
                "that sync did not land or landed wrong; if this run's sampler is this noisy, raise "
                "mismatch_kl_guard (0 turns the check off)"
            )
        if not self.history or mismatch_kl <= math.sqrt(self.ratio) * self.baseline:
            self.history = (self.history + [mismatch_kl])[-self.window :]
        return None

    def check_batch(self, global_step: int, metrics: dict[str, float]) -> str | None:
        """`check` for the batch trained at step `global_step + 1`. Every rank calls it with the metrics reduced over
        ranks, so all decide alike."""
        served = global_step - int(metrics.get("async_lag", 0))  # the version the server tagged the rollouts with
        trained = metrics.get("trained_tokens", 0.0) > 0
        return self.check(global_step + 1, metrics.get("mismatch_kl"), global_step, trained, served)
