"""CPU server start-up benchmark: seconds from launching the server process to its first healthy answer, the model
loaded through transformers' `from_pretrained` (what the server did before) vs built from the checkpoint by
`cpu/model/lean_model.py` (what it does now).

    .venv/bin/python benchmarks/bench_server_start.py [--quick]

Each start is `app.serve` in a process of its own, launched and health-polled by the trainer's launcher (as
`RLTrainer` and `vf-rl` start theirs), on the demo's tiny model (h128 x 2) saved to a folder; the two variants
differ only in `lean_load`. They alternate, start by start, so both see the same machine; each start is stopped
before the next. Reported: the median start of each and their ratio, and the server process's CPU seconds up to
its first healthy answer (most of a start is imports, which compete for the same 2 cores as the rollout process
starting beside it).

Why it matters: a run's first step waits for its server (and its rollout process, started at the same time), and
so does every restart after a crash; on 2 cores transformers' modeling import chain (torch.distributed.tensor,
sympy, torch._dynamo) was about a third of the server's start.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import cpu_server, finish, main_for, median, row, wait_for_quiet  # noqa: E402
from bench_async import _pid_cpu_s  # noqa: E402

NAME = "bench_server_start"
VARIANTS = {"from_pretrained": False, "ours": True}  # name -> lean_load


def run(quick: bool = False, wait_quiet: float | None = None) -> dict:
    from verifiers_rl.tiny import save_tiny_model

    t_start = time.perf_counter()
    rounds = 1 if quick else 6
    results: dict = {"name": NAME, "quick": quick, "rounds": rounds}
    seen = {name: {"start_s": [], "cpu_s": []} for name in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="bench_server_start_") as tmp:
        model = str(save_tiny_model(os.path.join(tmp, "tiny"), hidden=128, layers=2))
        results["machine_before"] = wait_for_quiet((0 if quick else 60) if wait_quiet is None else wait_quiet)
        for r in range(rounds + 1):  # round 0 warms the page cache for both
            for name, lean in VARIANTS.items():
                server = cpu_server(model, os.path.join(tmp, f"{name}-{r}"), lean_load=lean)
                t0 = time.perf_counter()
                try:
                    server.start()
                    took, cpu = time.perf_counter() - t0, _pid_cpu_s(server.process.pid)
                finally:
                    server.stop()
                if r:
                    seen[name]["start_s"].append(took)
                    seen[name]["cpu_s"].append(cpu)
    results["starts"] = seen
    base, ours = (median(seen[n]["start_s"]) for n in VARIANTS)
    base_cpu, ours_cpu = (median(seen[n]["cpu_s"]) for n in VARIANTS)
    rows = [
        row(f"CPU server start to healthy, tiny h128x2 (median of {rounds}): from_pretrained vs ours (lean model)",
            base, ours, base / ours, "(report)", None, unit="s"),
        row("its CPU seconds to healthy", base_cpu, ours_cpu, base_cpu / ours_cpu, "(report)", None, unit="s"),
    ]  # fmt: skip
    return finish(NAME, quick, results, t_start, [(f"CPU server start ({'quick' if quick else 'full'})", rows)])


def main(argv=None) -> int:
    return main_for(run, __doc__, "1 start of each (checks that it runs)", argv)


if __name__ == "__main__":
    sys.exit(main())
