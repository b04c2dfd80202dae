"""Endurance benchmark: a long tiny run must not leak. Memory, file descriptors and step time at the end of the run
against the same at an early reference step, for the trainer's process and its inference server's.

    .venv/bin/python benchmarks/bench_endurance.py [--quick]

One RLTrainer run (it spawns the CPU engine) on reverse-text with the tiny model: 2 prompts x 4 rollouts per step,
8 tokens, LoRA, max_async_level 1, a checkpoint every 100 steps (two kept), metrics every step. A callback reads,
at every step end, both processes' resident memory (/proc/<pid>/status VmRSS) and open descriptors (/proc/<pid>/fd)
and the wall clock. Full: 1,000 steps, reference step 100; quick: 40 steps, reference step 10.

Rows (baseline: the reference step; ours: the last step):
- trainer RSS and server RSS: growth after the reference step, goal <= 1.10x;
- open file descriptors of each: flat (at most 2 more than at the reference step);
- step time: median wall-clock per step over the last 10 % of the run against the 10 % after the reference step,
  goal <= 1.10x (a leak in a list the loop walks, or a cache that grows, shows here first).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import finish, main_for, median, row, wait_for_quiet  # noqa: E402

NAME = "bench_endurance"
GROWTH_GOAL = 1.10
FD_SLACK = 2


def _rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def probe(ref: dict):
    """A TrainerCallback that records both processes' RSS and descriptors, and the wall clock, at every step end."""
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        def __init__(self):
            self.marks: list[dict] = []

        def on_step_end(self, args, state, control, **kwargs):
            server = ref["trainer"].runtime.session.process.process.pid
            me = os.getpid()
            self.marks.append(
                {
                    "step": state.global_step,
                    "t": time.perf_counter(),
                    "trainer_rss": _rss_mib(me),
                    "server_rss": _rss_mib(server),
                    "trainer_fds": _fds(me),
                    "server_fds": _fds(server),
                }
            )

    return Probe()


def endure(tmp: str, steps: int) -> list[dict]:
    import verifiers as vf
    from transformers.trainer_callback import PrinterCallback

    from verifiers_rl.tiny import save_tiny_model
    from verifiers_rl.trainer import RLConfig, RLTrainer
    from verifiers_rl.trainer.callbacks import RichProgressCallback

    model = str(save_tiny_model(os.path.join(tmp, "tiny"), hidden=64, layers=2))
    env = vf.load_environment("reverse-text", num_train_examples=64, num_eval_examples=4)
    args = RLConfig(
        output_dir=os.path.join(tmp, "run"), use_cpu=True, batch_size=8, rollouts_per_example=4, micro_batch_size=8,
        max_tokens=8, max_seq_len=256, max_steps=steps, save_steps=100, save_total_limit=2, log_completions=False,
        report_to="none", server_mode="spawn", learning_rate=1e-4, max_async_level=1,
    )  # fmt: skip
    ref: dict = {}
    clock = probe(ref)
    trainer = RLTrainer(model=model, env=env, args=args, callbacks=[clock])
    trainer.remove_callback(RichProgressCallback)
    trainer.remove_callback(PrinterCallback)
    ref["trainer"] = trainer
    try:
        trainer.train()
    finally:
        trainer.close()
    return clock.marks


def summarize(marks: list[dict], ref_step: int) -> dict:
    at = {m["step"]: m for m in marks}
    first, last = at[ref_step], marks[-1]
    dts = {m["step"]: m["t"] - at[m["step"] - 1]["t"] for m in marks if m["step"] - 1 in at}
    window = max(len(marks) // 10, 3)
    early = [dts[s] for s in range(ref_step + 1, ref_step + 1 + window) if s in dts]
    late = [dts[s] for s in range(last["step"] - window + 1, last["step"] + 1) if s in dts]
    return {
        "ref_step": ref_step,
        "last_step": last["step"],
        "at_ref": first,
        "at_end": last,
        "step_s_early": median(early),
        "step_s_late": median(late),
        "peaks": {k: max(m[k] for m in marks if m["step"] >= ref_step) for k in ("trainer_rss", "server_rss")},
    }


def run(quick: bool = False, wait_quiet: float | None = None) -> dict:
    t_start = time.perf_counter()
    steps, ref_step = (40, 10) if quick else (1000, 100)
    results: dict = {"name": NAME, "quick": quick, "steps": steps}
    results["machine_before"] = wait_for_quiet((0 if quick else 120) if wait_quiet is None else wait_quiet)
    with tempfile.TemporaryDirectory(prefix="bench_endurance_") as tmp:
        marks = endure(tmp, steps)
    s = results["summary"] = summarize(marks, ref_step)
    a, b = s["at_ref"], s["at_end"]
    span = f"step {ref_step} -> {s['last_step']}"
    rows = []
    for who in ("trainer", "server"):
        growth = b[f"{who}_rss"] / a[f"{who}_rss"]
        rows.append(row(f"{who} RSS, {span}", a[f"{who}_rss"], b[f"{who}_rss"], growth, f"<={GROWTH_GOAL}x",
                        growth <= GROWTH_GOAL, unit="MiB"))  # fmt: skip
    for who in ("trainer", "server"):
        before, after = a[f"{who}_fds"], b[f"{who}_fds"]
        rows.append(row(f"{who} open file descriptors, {span}", before, after, after / before,
                        f"flat (<= +{FD_SLACK})", after <= before + FD_SLACK))  # fmt: skip
    drift = s["step_s_late"] / s["step_s_early"]
    rows.append(row(f"step time, last 10% vs 10% after step {ref_step}", s["step_s_early"], s["step_s_late"], drift,
                    f"<={GROWTH_GOAL}x", drift <= GROWTH_GOAL, unit="s"))  # fmt: skip
    results["marks"] = marks[:: max(len(marks) // 200, 1)]  # the curve, thinned
    return finish(NAME, quick, results, t_start, [(f"endurance ({'quick' if quick else 'full'})", rows)])


def main(argv=None) -> int:
    return main_for(run, __doc__, "40 steps (about a minute)", argv)


if __name__ == "__main__":
    sys.exit(main())
