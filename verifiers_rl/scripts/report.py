"""End-of-run report: the reward curve (PNG) from metrics.jsonl and the eval before/after comparison."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(output_dir: str | Path) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        acc = acc[-window:]
        out.append(sum(acc) / len(acc))
    return out


def plot_reward_curve(output_dir: str | Path, before: float | None = None, after: float | None = None) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(output_dir)
    train = [(r["step"], r["reward"]) for r in rows if "reward" in r]
    evals = [
        (r["step"], v)
        for r in rows
        for k, v in r.items()
        if k.endswith("/reward") and k.startswith("eval") and "greedy" not in k
    ]
    if not train and not evals:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        steps, rewards = zip(*train)
        ax.plot(steps, rewards, color="#9bb7d4", lw=1, label="train reward (batch mean)")
        ax.plot(
            steps,
            _smooth(list(rewards), max(1, len(rewards) // 10)),
            color="#1f5fa8",
            lw=2,
            label="train reward (smoothed)",
        )
    if evals:
        es, ev = zip(*evals)
        ax.scatter(es, ev, color="#d1495b", zorder=3, label="eval reward")
    for value, label in ((before, "eval before RL"), (after, "eval after RL")):
        if value is not None:
            ax.axhline(
                value, ls="--", lw=1, color="#d1495b" if "after" in label else "#888888", label=f"{label}: {value:.3f}"
            )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(Path(output_dir).name)
    fig.tight_layout()
    out = Path(output_dir) / "reward_curve.png"
    fig.savefig(out)
    plt.close(fig)
    return out


def _reward(metrics: dict | None) -> float | None:
    if not metrics:
        return None
    return next((v for k, v in metrics.items() if k.endswith("/reward")), None)


def summarize(evals: dict[str, dict | None]) -> dict:
    """summary.json's numbers from the run's evaluations: `evals` maps "before" / "after" (around RL), "base" (the
    model before the SFT warm-start) and the same names + "_greedy" (temperature 0) to evaluate()'s metrics."""
    summary: dict = {}
    for kind, suffix in (("eval_reward", ""), ("eval_greedy_reward", "_greedy")):
        base, b, a = (_reward(evals.get(when + suffix)) for when in ("base", "before", "after"))
        if base is not None:
            summary[f"{kind}_base"] = base
        if b is not None or a is not None or not suffix:
            summary[f"{kind}_before"], summary[f"{kind}_after"] = b, a
        if b is not None and a is not None:
            summary[f"{kind}_delta"] = a - b  # RL's share
        if base is not None and b is not None:
            summary[f"{kind}_sft_delta"] = b - base  # the warm-start's share
    return summary


def write_report(output_dir: str | Path, evals: dict[str, dict | None]) -> dict:
    summary = summarize(evals)
    b, a = summary["eval_reward_before"], summary["eval_reward_after"]
    png = plot_reward_curve(output_dir, b, a)
    summary["reward_curve"] = str(png) if png else None
    for kind, name in (("eval_reward", "eval reward"), ("eval_greedy_reward", "greedy eval reward")):
        if f"{kind}_base" in summary and summary.get(f"{kind}_before") is not None:
            base, b = summary[f"{kind}_base"], summary[f"{kind}_before"]
            print(f"{name}: base {base:.4f} -> after SFT {b:.4f} ({b - base:+.4f})", flush=True)
        if f"{kind}_delta" in summary:
            b, a = summary[f"{kind}_before"], summary[f"{kind}_after"]
            print(f"{name}: before RL {b:.4f} -> after RL {a:.4f} ({a - b:+.4f})", flush=True)
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    if png:
        print(f"reward curve: {png}", flush=True)
    return summary
