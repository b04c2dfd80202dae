"""The reward curve: train reward per step (batch mean and smoothed), eval points, eval before/after lines.

One drawing for the end-of-run report (`reward_curve.png`), the model card of `final/`, and a notebook's live view
(`LiveRewardCurve`). Rows are log lines with a "step": metrics.jsonl rows or `TrainerState.log_history`.
"""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path

from transformers import TrainerCallback


def read_metrics(output_dir: str | os.PathLike) -> list[dict]:
    """The rows MetricsFileCallback wrote to <output_dir>/metrics.jsonl ([] when there is none); a last line cut by a
    kill mid-write is skipped."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def _is_eval_reward(key: str) -> bool:
    # greedy evals are reported in summary.json, not plotted: one eval series per curve
    return key.startswith("eval") and key.endswith("/reward") and "greedy" not in key


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        acc = acc[-window:]
        out.append(sum(acc) / len(acc))
    return out


def has_rewards(rows: list[dict]) -> bool:
    return any("reward" in r or any(_is_eval_reward(k) for k in r) for r in rows)


def draw(rows: list[dict], *, before: float | None = None, after: float | None = None, title: str = ""):
    """A matplotlib Figure of the curve (no pyplot: nothing global, safe beside a notebook's own figures)."""
    from matplotlib.figure import Figure

    train = [(r["step"], r["reward"]) for r in rows if "reward" in r]
    evals = [(r["step"], v) for r in rows for k, v in r.items() if _is_eval_reward(k)]
    fig = Figure(figsize=(7, 4), dpi=110)
    ax = fig.add_subplot()
    if train:
        steps, rewards = zip(*train)
        ax.plot(steps, rewards, color="#9bb7d4", lw=1, label="train reward (batch mean)")
        smooth = _smooth(list(rewards), max(1, len(rewards) // 10))
        ax.plot(steps, smooth, color="#1f5fa8", lw=2, label="train reward (smoothed)")
    for name in sorted({k for r in rows for k in r if k.startswith("reward/")}):  # several environments: one line each
        points = [(r["step"], r[name]) for r in rows if name in r]
        ax.plot(*zip(*points), lw=1, ls=":", label=f"train {name}")
    if evals:
        es, ev = zip(*evals)
        ax.scatter(es, ev, color="#d1495b", zorder=3, label="held-out eval reward")
    for value, label, color in ((before, "eval before RL", "#888888"), (after, "eval after RL", "#d1495b")):
        if value is not None:
            ax.axhline(value, ls="--", lw=1, color=color, label=f"{label}: {value:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    return fig


def save_reward_curve(rows: list[dict], path: str | Path, **kwargs) -> Path | None:
    """Write the curve as a PNG; None (and no file) when the rows hold no reward."""
    if not has_rewards(rows):
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    draw(rows, **kwargs).savefig(path)
    return path


class _CurveView:
    """What a notebook shows: the PNG, and a line of text for consoles and for reading the output back."""

    def __init__(self, png: bytes, caption: str):
        self.png, self.caption = png, caption

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"image/png": base64.b64encode(self.png).decode(), "text/plain": self.caption}


class LiveRewardCurve(TrainerCallback):
    """In a notebook: the reward curve drawn under the cell and redrawn in place at every logged step (IPython's
    display with a display id), so a long `trainer.train()` shows how it is going while it runs.

        trainer = RLTrainer(model=..., env=env, args=args, callbacks=[LiveRewardCurve()])
    """

    def __init__(self, title: str = ""):
        try:
            from IPython.display import display
        except ImportError:
            raise ImportError(
                "LiveRewardCurve shows the curve in a notebook: it needs IPython (pip install ipython)"
            ) from None
        self._display = display
        self.title = title
        self.rows: list[dict] = []
        self.handle = None
        self.updates = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.rows = [r for r in state.log_history if "step" in r]  # a resumed run's curve starts where it was

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or not has_rewards([logs]):
            return
        self.rows.append({**logs, "step": state.global_step})
        buf = io.BytesIO()
        draw(self.rows, title=self.title or Path(args.output_dir).name).savefig(buf, format="png")
        train = [r["reward"] for r in self.rows if "reward" in r]
        evals = [v for r in self.rows for k, v in r.items() if _is_eval_reward(k)]
        caption = f"reward curve: step {state.global_step}/{state.max_steps}"
        caption += f", train reward {train[-1]:.3f}" if train else ""
        caption += f", eval reward {evals[-1]:.3f}" if evals else ""
        view = _CurveView(buf.getvalue(), caption)
        if self.handle is None:
            self.handle = self._display(view, display_id=True)
        else:
            self.handle.update(view)
        self.updates += 1
