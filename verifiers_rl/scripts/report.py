"""End-of-run report: the reward curve (PNG) from metrics.jsonl and the eval before/after comparison."""

from __future__ import annotations

import json
from pathlib import Path

from verifiers_rl.export.reward_curve import read_metrics


def plot_reward_curve(output_dir: str | Path, before: float | None = None, after: float | None = None) -> Path | None:
    """<output_dir>/reward_curve.png from metrics.jsonl (None when it holds no reward)."""
    from verifiers_rl.export.reward_curve import save_reward_curve

    rows = read_metrics(output_dir)
    path = Path(output_dir) / "reward_curve.png"
    return save_reward_curve(rows, path, before=before, after=after, title=Path(output_dir).name)


def _reward(metrics: dict | None, name: str = "reward") -> float | None:
    if not metrics:
        return None
    return next((v for k, v in metrics.items() if k.endswith(f"/{name}")), None)


def summarize(evals: dict[str, dict | None]) -> dict:
    """summary.json's numbers from the run's evaluations: `evals` maps "before" / "after" (around RL), "base" (the
    model before the SFT warm-start) and the same names + "_greedy" (temperature 0) to evaluate()'s metrics.
    `eval[_greedy]_perfect_<when>`: the share of those rollouts that scored 1.0."""
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
        for when in ("base", "before", "after"):  # the share of rollouts scoring 1.0, where the eval reports it
            rate = _reward(evals.get(when + suffix), "perfect_frac")
            if rate is not None:
                summary[f"{kind.replace('reward', 'perfect')}_{when}"] = rate
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
        rates = [(w, summary.get(f"{kind.replace('reward', 'perfect')}_{w}")) for w in ("base", "before", "after")]
        if any(r is not None for _, r in rates):
            shown = " -> ".join(f"{w} {r:.2f}" for w, r in rates if r is not None)
            print(f"{name.replace('reward', 'perfect-score rate')}: {shown}", flush=True)
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    if png:
        print(f"reward curve: {png}", flush=True)
    return summary
