"""The framework's own share of a training step: wall time that is not the wait for rollouts, forward/backward, the
optimizer or the weight sync (batching, bookkeeping, logging, callbacks, HTTP outside generation).

    .venv/bin/python benchmarks/bench_overhead.py [--quick] [--profile]

Real training steps: `RLTrainer` with its own CPU engine server over HTTP, the real reverse-text environment, the
trainer's own stage timers (`verifiers_rl/trainer/step_timing.py`: `timing/<stage>_s`, `timing/wall_s`,
`timing/framework_s`; wall time runs from one step's log line to the next, so the loop's work between steps counts).
Two geometries, each at the demo's `max_async_level` (1: generation overlaps training; only the wait counts), and
the demo's at 0 as well (on-policy: generation is all waited for):
- demo: configs/vf-rl/tiny-reverse-text.toml's model (byte-level tiny Qwen3, hidden 128, 2 layers), LoRA r16 with
  the norms trained, 8 prompts x 8 rollouts, one padded micro-batch of 64, 48 completion tokens, temperature 1.4;
  random (not warm-started) weights, so completions run to max_tokens: the slowest generation of that geometry.
- qwen0.6b: Qwen3-0.6B's layer shape (hidden 1024, 16 heads / 8 kv heads of 128, intermediate 3072, tied 151,936-row
  vocabulary, Qwen's BPE from `verifiers_rl.tiny.qwen`) with 2 of its 28 layers so that it runs on CPU; LoRA r16,
  4 prompts x 4 rollouts, 32 completion tokens.
Reported per geometry: the median over steps 2.. (step 1 is warm-up) of each stage's seconds and of the framework
share, and the share of the summed seconds; an outside clock (a callback's step-end marks) checks the wall time.
Goal: framework share <= 3 %. --profile also runs the demo geometry under cProfile (the trainer's thread: the
step's critical path) and records the functions with the most own time outside torch's kernels.
--quick: the demo geometry at 2 prompts x 4 rollouts, 2 timed steps (a smoke test of the path; no goal).
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import tempfile
import time
import tomllib
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import arg_parser, finish, git_commit, median, row, wait_for_quiet  # noqa: E402
from bench_async import rl_config, run_rl, window_stats  # noqa: E402

NAME = "bench_overhead"
GOAL = 0.03
STAGES = ("rollouts_wait", "train", "optimizer", "sync")
DEMO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "vf-rl" / "tiny-reverse-text.toml"
# the demo's own settings, read from its config (a run's length, name and checkpoints are the benchmark's)
_DEMO = tomllib.loads(DEMO_CONFIG.read_text())
DEMO_ARGS = {k: v for k, v in _DEMO["trainer"]["args"].items() if k not in ("run_name", "max_steps", "save_steps")}
QWEN_SHAPE = dict(
    hidden=1024,
    layers=2,
    head_dim=128,
    num_attention_heads=16,
    num_key_value_heads=8,
    intermediate_size=3072,
    tie_word_embeddings=True,
)
QWEN_ARGS = dict(
    DEMO_ARGS,
    lora_modules_to_save=None,
    learning_rate=1e-4,
    rollouts_per_example=4,
    batch_size=16,
    micro_batch_size=16,
    pack_sequences=True,
    max_tokens=32,
    max_seq_len=256,
    temperature=1.0,
)


def build_model(geometry: str, path: str) -> str:
    if geometry == "qwen0.6b":
        from verifiers_rl.tiny.qwen import save_qwen_model

        return str(save_qwen_model(path, seed=0, **QWEN_SHAPE))
    from verifiers_rl.tiny import save_tiny_model

    return str(save_tiny_model(path, **_DEMO["tiny"]))


def summarize(metrics: list[dict], marks: list[dict]) -> dict:
    """Per-stage medians over steps 2.. and the framework share (median of steps, and of the summed seconds)."""
    timed = [m for m in metrics if m["step"] >= 2]
    keys = [*STAGES, "framework", "wall"]
    per_step = {k: [m.get(f"timing/{k}_s", 0.0) for m in timed] for k in keys}
    out = {f"{k}_s": median(v) for k, v in per_step.items()}
    out["generation_s"] = median([m.get("timing/generation_s", 0.0) for m in timed])
    out["generation_overlapped_s"] = median([m.get("timing/generation_overlapped_s", 0.0) for m in timed])
    out["framework_frac"] = median([m["timing/framework_frac"] for m in timed])
    out["framework_frac_of_sums"] = sum(per_step["framework"]) / max(sum(per_step["wall"]), 1e-9)
    out["outside_step_s"] = window_stats(marks, 1)["step_s"] if len(marks) >= 2 else float("nan")
    out["per_step"] = {k: [round(x, 5) for x in v] for k, v in per_step.items()}
    out["timed_steps"] = len(timed)
    return out


def one_geometry(
    label: str, geometry: str, tmp: str, env, steps: int, overrides: dict, log, profile: bool = False
) -> dict:
    model_dir = os.path.join(tmp, f"model_{geometry}")
    if not os.path.isdir(model_dir):
        build_model(geometry, model_dir)
    cfg = {"max_async_level": 1, **(QWEN_ARGS if geometry == "qwen0.6b" else DEMO_ARGS), **overrides}
    out_dir = os.path.join(tmp, "run_" + "".join(c if c.isalnum() else "_" for c in label))
    args = rl_config(out_dir, max_steps=steps + 1, **cfg)
    prof = cProfile.Profile() if profile else None
    res = run_rl(model_dir, env, args, log, callbacks=(profiling(prof),) if prof is not None else ())
    stats = summarize(res["metrics"], res["marks"])
    stats.update(geometry=geometry, config={k: v for k, v in cfg.items()}, startup_s=res["startup_s"])
    log(
        f"{label}: wall {stats['wall_s']:.3f}s (outside clock {stats['outside_step_s']:.3f}s): wait "
        f"{stats['rollouts_wait_s']:.3f}, train {stats['train_s']:.3f}, optimizer {stats['optimizer_s']:.4f}, sync "
        f"{stats['sync_s']:.3f}, framework {stats['framework_s']:.3f} = {stats['framework_frac']:.1%} "
        f"(of sums {stats['framework_frac_of_sums']:.1%}); generation {stats['generation_s']:.3f} of which "
        f"{stats['generation_overlapped_s']:.3f} overlapped"
    )
    if prof is not None:
        stats["profile_top"] = top_functions(prof)
    return stats


def profiling(prof: cProfile.Profile):
    """A callback profiling the trainer's thread from the second step on (the first is warm-up)."""
    from transformers import TrainerCallback

    class Profiling(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                prof.enable()

        def on_train_end(self, args, state, control, **kwargs):
            prof.disable()

    return Profiling()


def top_functions(prof: cProfile.Profile, n: int = 20) -> list[dict]:
    """The Python functions with the most own time outside the model's compute (torch's operators, torch.nn, the
    model and peft layers' forward code), each with its three heaviest callers: where the framework's seconds go."""
    compute = ("/torch/", "/peft/tuners/", "/transformers/models/")
    rows = []
    for (path, line, fn), (_cc, calls, own, cum, callers) in pstats.Stats(prof).stats.items():
        if (path == "~" and "torch" in fn) or any(c in path for c in compute):
            continue
        heavy = sorted(callers.items(), key=lambda kv: -kv[1][3])[:3]
        rows.append(
            {
                "function": f"{_short(path)}:{line}({fn})",
                "calls": calls,
                "own_s": round(own, 4),
                "cum_s": round(cum, 4),
                "callers": [f"{_short(p)}:{ln}({f})" for (p, ln, f), _ in heavy],
            }
        )
    rows.sort(key=lambda r: -r["own_s"])
    return rows[:n]


def _short(path: str) -> str:
    if path == "~":  # a builtin
        return path
    return path.split("site-packages/")[-1] if "site-packages/" in path else os.path.relpath(path)


def run(quick: bool = False, wait_quiet: float | None = None, profile: bool = False) -> dict:
    import verifiers as vf

    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    results: dict = {"name": NAME, "quick": quick, "commit": git_commit()}
    results["machine_before"] = wait_for_quiet((0 if quick else 180) if wait_quiet is None else wait_quiet, log=log)
    env = vf.load_environment(
        "reverse-text", num_train_examples=400, num_eval_examples=20, seed=0, system_prompt="Reverse the text."
    )
    if quick:
        plan = [("demo", "demo", 2, dict(rollouts_per_example=4, batch_size=8, micro_batch_size=8, max_tokens=16))]
    else:  # k = 0 too: generation on the critical path, the wait as a stage
        plan = [("demo", "demo", 8, {}), ("demo k=0", "demo", 8, {"max_async_level": 0})]
        plan.append(("qwen0.6b", "qwen0.6b", 4, {}))
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_overhead_") as tmp:
        for label, geometry, steps, overrides in plan:
            runs[label] = one_geometry(label, geometry, tmp, env, steps, overrides, log)
        if profile:
            runs["demo (cProfile)"] = one_geometry("demo (cProfile)", "demo", tmp, env, 5, {}, log, profile=True)
    results["runs"] = runs
    rows = []
    for label, r in runs.items():
        if "cProfile" in label:
            continue
        rows.append(
            row(
                f"{label}: framework share of the step (wall {r['wall_s']:.3f}s: wait {r['rollouts_wait_s']:.3f}, "
                f"train {r['train_s']:.3f}, optimizer {r['optimizer_s']:.3f}, sync {r['sync_s']:.3f}, framework "
                f"{r['framework_s']:.3f}); median of steps 2..{r['timed_steps'] + 1}",
                None,
                r["framework_frac"],
                None,
                "(report)" if quick else f"<= {GOAL:.0%}",
                None if quick else r["framework_frac"] <= GOAL,
                unit="frac",
            )
        )
    title = f"framework overhead ({'quick' if quick else 'full'}; step 1 is warm-up)"
    return finish(NAME, quick, results, t_start, [(title, rows)])


def main(argv=None) -> int:
    p = arg_parser(__doc__, "the demo geometry only, small batch, 2 timed steps")
    p.add_argument("--profile", action="store_true", help="also profile the demo geometry's steps (cProfile)")
    args = p.parse_args(argv)
    return 0 if run(quick=args.quick, wait_quiet=args.wait_quiet, profile=args.profile)["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
