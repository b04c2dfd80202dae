"""How the cost of an RL step grows with the work: TRL's GRPOTrainer vs ours (RLTrainer + its own CPU inference
server), s/step against batch size, completion length and model size, in one run on one machine.

    .venv/bin/python benchmarks/bench_scaling.py [--quick]

Every point runs both trainers with bench_e2e's like-for-like settings (same data, reward, LoRA r 8 / alpha 32 on all
projections, "dapo" loss, temperature 1, AdamW, constant lr, one padded or packed micro-batch per step) for a few
steps; s/step is the median over steps 2..N (the first step pays for warm-up in both). Ours runs with the default
max_async_level = 1.

Models have random weights (built offline): a random policy almost never emits EOS, so completions run to the length
under test in both trainers (each side's mean completion length is recorded to show it). Shapes: the tiny demo model
(hidden 128, 2 layers, 0.4M parameters), hidden 512 x 8 layers (17M), and Qwen3-0.6B's shape (hidden 1024, 28 layers,
16 heads / 8 KV heads of 128, MLP 3072) with our 259-token byte vocabulary instead of Qwen's 151k, so 0.44B
parameters rather than 0.6B (the vocabulary's 155M embedding parameters would only add lm_head work to both sides).

Goal rows (issue 14, item 5): TRL's s/step over ours >= 1.5 at 32 and at 128 completion tokens (tiny model, 8 prompts
x 8 rollouts). The other points are reported, and drawn in benchmarks/results/bench_scaling.png.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import RESULTS_DIR, finish, main_for, median, row, wait_for_quiet  # noqa: E402
from bench_async import window_stats  # noqa: E402
from bench_e2e import run_ours, run_trl  # noqa: E402

NAME = "bench_scaling"
GOAL = 1.5  # TRL s/step / ours s/step at the goal lengths
GOAL_LENGTHS = (32, 128)
LR = 1e-3
# name -> verifiers_rl.tiny.save_tiny_model arguments (untied lm_head, byte vocabulary, float32); the tiny builder
# derives heads = hidden / head_dim, KV heads = heads / 2 and MLP = 2 x hidden unless a Qwen3Config field is given
SHAPES = {
    "tiny h128x2": dict(hidden=128, layers=2),
    "h512x8": dict(hidden=512, layers=8, head_dim=64),
    "Qwen3-0.6B shape": dict(
        hidden=1024, layers=28, head_dim=128, num_attention_heads=16, num_key_value_heads=8, intermediate_size=3072
    ),
}


def grid(quick: bool) -> list[dict]:
    """The points: (axis, model shape, prompts, group, completion tokens, steps)."""
    pt = lambda axis, shape, p, g, t, steps: dict(axis=axis, shape=shape, prompts=p, group=g, tokens=t, steps=steps)  # noqa: E731
    if quick:
        return [pt("length", "tiny h128x2", 2, 2, t, 3) for t in (8, 16)]
    tiny = "tiny h128x2"
    points = [pt("length", tiny, 8, 8, t, 6) for t in (16, 32, 64, 128)]
    points += [pt("batch", tiny, p, g, 32, 6) for p, g in ((2, 4), (4, 8), (16, 8))]  # 8x8 at 32: the length axis
    points += [pt("model", shape, 2, 4, 32, 4) for shape in SHAPES]
    return points


def build_model(path: str, shape: str) -> str:
    """A random-weight Qwen3 of the given shape with the tiny byte tokenizer, saved like a hub checkpoint (cached)."""
    from verifiers_rl.tiny import save_tiny_model

    if not os.path.exists(os.path.join(path, "config.json")):
        save_tiny_model(path, **SHAPES[shape])
    return path


def parameters(path: str) -> int:
    """Exact parameter count, read from the checkpoint's tensor shapes (nothing is loaded)."""
    from math import prod

    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return sum(prod(f.get_slice(k).get_shape()) for k in f.keys())


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def measure(point: dict, model_dir: str, env, train_rows, tmp: str, log) -> dict:
    s = dict(
        prompts=point["prompts"],
        group=point["group"],
        max_tokens=point["tokens"],
        steps=point["steps"],
        lr=LR,
        micro_batch_size=point["prompts"] * point["group"],
    )
    tag = f"{point['axis']}-{point['shape'].replace(' ', '_')}-{s['prompts']}x{s['group']}-{s['max_tokens']}"
    trl = run_trl(model_dir, train_rows, [], s, os.path.join(tmp, "trl-" + tag), log, evaluate=False)
    ours = run_ours(model_dir, env, [], s, 1, os.path.join(tmp, "ours-" + tag), log, evaluate=False)
    out = dict(point)
    for name, r in (("trl", trl), ("ours", ours)):
        st = window_stats(r["marks"], 1)
        out[name] = {
            "s_per_step": st["step_s"],
            "all_step_s": st["all_step_s"],
            "completion_len": mean(r.get("completion_len") or []),
            "machine_busy": st["machine_busy"],
        }
    for key in ("gen_s", "train_s", "wait_s"):  # ours' phases (k=1: generation overlaps training)
        out["ours"][key] = median([x for x in ours[key][1:] if x is not None] or [float("nan")])
    out["speedup"] = out["trl"]["s_per_step"] / out["ours"]["s_per_step"]
    log(
        f"{tag}: TRL {out['trl']['s_per_step']:.2f} s/step (completions {out['trl']['completion_len'] or 0:.1f}), ours "
        f"{out['ours']['s_per_step']:.2f} s/step (completions {out['ours']['completion_len'] or 0:.1f}; generation "
        f"{out['ours']['gen_s']:.2f} s, training {out['ours']['train_s']:.2f} s): {out['speedup']:.2f}x"
    )
    return out


def on_axis(p: dict, axis: str) -> bool:
    """The batch axis also holds the length axis's 8x8 point at 32 tokens (measured once)."""
    return p["axis"] == axis or (axis == "batch" and p["axis"] == "length" and p["tokens"] == 32)


def plot(points: list[dict], path) -> str | None:
    """Three panels (batch, completion length, model size): s/step of TRL and ours, log-log."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return None
    axes_spec = (
        ("batch", "rollouts per step (32 completion tokens, tiny model)", lambda p: p["prompts"] * p["group"]),
        ("length", "completion tokens (8x8 rollouts, tiny model)", lambda p: p["tokens"]),
        ("model", "parameters (2x4 rollouts, 32 tokens)", lambda p: p["params"]),
    )
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, (axis, label, x_of) in zip(axes, axes_spec):
        pts = sorted((p for p in points if on_axis(p, axis)), key=x_of)
        if not pts:
            ax.set_visible(False)
            continue
        xs = [x_of(p) for p in pts]
        for name, style in (("trl", "o--"), ("ours", "s-")):
            ax.plot(
                xs, [p[name]["s_per_step"] for p in pts], style, label="TRL GRPOTrainer" if name == "trl" else "ours"
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(xs, [f"{x / 1e6:.1f}M" if x >= 1e5 else str(x) for x in xs])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel(label)
        ax.set_ylabel("s / step")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("RL step time vs work: TRL GRPOTrainer (in-process generate) vs verifiers-rl (own CPU server)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def run(quick: bool = False, wait_quiet: float | None = None) -> dict:
    import verifiers as vf

    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    results: dict = {"name": NAME, "quick": quick, "cores": os.cpu_count() or 1, "lr": LR, "shapes": SHAPES}
    results["machine_before"] = wait_for_quiet((0 if quick else 180) if wait_quiet is None else wait_quiet, log=log)
    env = vf.load_environment("reverse-text", num_train_examples=400, num_eval_examples=0, seed=0)
    train_rows = [dict(r) for r in env.get_dataset()]
    cache = os.environ.get("VF_BENCH_CACHE", "/tmp/vf_rl_bench_cache")
    points = []
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
        for p in grid(quick):
            model_dir = build_model(os.path.join(cache, "scaling-" + p["shape"].replace(" ", "_")), p["shape"])
            p["params"] = parameters(model_dir)
            points.append(measure(p, model_dir, env, train_rows, tmp, log))
    results["points"] = points
    rows = []
    for p in points:
        goal = p["axis"] == "length" and p["tokens"] in GOAL_LENGTHS and not quick
        rows.append(
            row(
                f"s/step TRL vs ours, {p['shape']} ({p['params'] / 1e6:.1f}M), {p['prompts']}x{p['group']} rollouts, "
                f"{p['tokens']} tok (mean completion TRL {p['trl']['completion_len'] or 0:.0f} / ours "
                f"{p['ours']['completion_len'] or 0:.0f})",
                p["trl"]["s_per_step"],
                p["ours"]["s_per_step"],
                p["speedup"],
                f">={GOAL}x" if goal else "(report)",
                p["speedup"] >= GOAL if goal else None,
                unit="s",
            )
        )
    results["plot"] = plot(points, RESULTS_DIR / f"{NAME}{'_quick' if quick else ''}.png")
    title = f"step time vs work ({'quick' if quick else 'full'}; ours max_async_level 1; random-weight models)"
    return finish(NAME, quick, results, t_start, [(title, rows)], notes=(f"plot: {results['plot']}",))


def main(argv=None) -> int:
    return main_for(run, __doc__, "two tiny points (2x2 rollouts, 8 and 16 tokens, 3 steps)", argv)


if __name__ == "__main__":
    sys.exit(main())
