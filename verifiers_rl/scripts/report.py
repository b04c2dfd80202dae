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
    evals = [(r["step"], v) for r in rows for k, v in r.items() if k.endswith("/reward") and k.startswith("eval")]
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


def write_report(output_dir: str | Path, before: dict | None, after: dict | None) -> dict:
    b, a = _reward(before), _reward(after)
    png = plot_reward_curve(output_dir, b, a)
    summary = {"eval_reward_before": b, "eval_reward_after": a, "reward_curve": str(png) if png else None}
    if b is not None and a is not None:
        summary["eval_reward_delta"] = a - b
        print(f"eval reward: before RL {b:.4f} -> after RL {a:.4f} ({a - b:+.4f})", flush=True)
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    if png:
        print(f"reward curve: {png}", flush=True)
    return summary
