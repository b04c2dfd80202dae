"""How long torch's OpenMP threads spin before they sleep, for the processes our commands start.

torch's CPU wheels run their intra-op threads on GNU OpenMP (libgomp), whose idle workers spin up to 300,000
iterations before sleeping. On an idle machine that saves a wake-up per parallel region; on a machine where
something else runs, a spinning worker holds a core that the thread it waits for needs. GOMP_SPINCOUNT=10000
keeps the idle speed and about halves the time on a loaded machine; OMP_WAIT_POLICY=PASSIVE costs idle speed
(benchmarks/results/design_measurements.md#openmp-spin-count).

libgomp reads its settings once, when torch loads it: this only acts on a process that has not imported torch yet,
and on the processes it starts (they inherit the environment; a vLLM server that vf-rl starts does too). A user's
own GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)

SPIN_COUNT = "10000"


# Kept by bench_cpu_tunings' row "fwd+bwd loop: libgomp default vs GOMP_SPINCOUNT=10000", loaded (>= 1.1x).
def bound_openmp_spin(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set GOMP_SPINCOUNT unless the user chose a spin or wait policy; True when it was set."""
    environ = os.environ if environ is None else environ
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True


class TrainerThreads:
    """The trainer's share of the cores while our CPU engine generates beside it (the plan's `threads`: server,
    trainer), and the count it had before, given back when the server goes."""

    def __init__(self):
        self._before: int | None = None

    def take(self, threads: tuple[int, int] | None) -> None:
        import torch

        if threads and self._before is None:
            self._before = torch.get_num_threads()
            torch.set_num_threads(threads[1])
            logger.info(
                "CPU engine and trainer overlap on %d cores: server %d threads, trainer %d", sum(threads), *threads
            )

    def give_back(self) -> None:
        import torch

        if self._before is not None:
            torch.set_num_threads(self._before)
            self._before = None
