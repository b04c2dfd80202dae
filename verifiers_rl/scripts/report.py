"""End-of-run report: the reward curve (PNG) from metrics.jsonl and the eval before/after comparison."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(output_dir: str | Path) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_reward_curve(output_dir: str | Path, before: float | None = None, after: float | None = None) -> Path | None:
    """<output_dir>/reward_curve.png from metrics.jsonl (None when it holds no reward)."""
    from verifiers_rl.rl.trainer.reward_curve import save_reward_curve

    rows = read_metrics(output_dir)
    path = Path(output_dir) / "reward_curve.png"
    return save_reward_curve(rows, path, before=before, after=after, title=Path(output_dir).name)


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
