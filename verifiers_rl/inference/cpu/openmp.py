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

import os
from collections.abc import MutableMapping

SPIN_COUNT = "10000"


# Kept by bench_cpu_tunings' row "fwd+bwd loop: libgomp default vs GOMP_SPINCOUNT=10000", loaded (>= 1.1x).
def bound_openmp_spin(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set GOMP_SPINCOUNT unless the user chose a spin or wait policy; True when it was set."""
    environ = os.environ if environ is None else environ
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True
