"""Callbacks for people: a rich progress bar with a sample panel, metrics.jsonl, and our metric names as
transformers' logging integrations (wandb, TensorBoard, ...) expect them."""

from __future__ import annotations

import json
import math
import os

from transformers import TrainerCallback


class MetricsFileCallback(TrainerCallback):
    """Appends every log line to <output_dir>/metrics.jsonl (plot it with any tool; vf-rl draws the curve)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        os.makedirs(args.output_dir, exist_ok=True)
        values = {k: v for k, v in logs.items() if _jsonable(v)}
        if not values:
            return
        row = {"step": state.global_step, **values}
        with open(os.path.join(args.output_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


def integration_names(logs: dict) -> dict:
    """Our eval metrics are `<prefix>/<name>` ("eval/reward", "eval_after/reward"). transformers' integrations file a
    key under eval/ only when it starts with "eval_" and put every other key under train/, so "eval/reward" would
    be charted as "train/eval/reward": give them "eval_reward" (charted as "eval/reward")."""
    return {("eval_" + k[5:] if k.startswith("eval/") else k): v for k, v in logs.items()}


def adapt_integrations(callbacks, output_dir: str) -> None:
    """transformers' own logging callbacks (report_to) as an RL run needs them: fed `integration_names(logs)` (every
    other callback, and metrics.jsonl, keep our names), and TensorBoard's folder fixed before the first log. An
    evaluation before train() logs before `on_train_begin`, where TensorBoardCallback picks <output_dir>/runs/...;
    left unset, its writer opens in the working directory instead."""
    from transformers.integrations import TensorBoardCallback
    from transformers.integrations.integration_utils import default_logdir

    for callback in callbacks:
        if not type(callback).__module__.startswith("transformers.integrations"):
            continue
        if isinstance(callback, TensorBoardCallback) and callback.logging_dir is None:
            callback.logging_dir = os.path.join(output_dir, default_logdir())
        on_log = callback.on_log

        def renamed(args, state, control, logs=None, _on_log=on_log, **kwargs):
            return _on_log(args, state, control, logs=integration_names(logs or {}), **kwargs)

        callback.on_log = renamed


def _jsonable(v) -> bool:
    return isinstance(v, (int, str, bool)) or (isinstance(v, float) and math.isfinite(v))


# the per-step line's training numbers, in the words of the tutorial and docs/training.md's metrics table
STEP_LINE = (("loss", "loss", ".4f"), ("entropy", "entropy", ".3f"), ("ratio_mean", "importance ratio", ".3f"))


def step_line(logs: dict) -> str:
    """reward, the loss, entropy, importance ratio and learning rate of the step, throughput and lag."""
    parts = [f"reward {logs['reward']:.3f}"]
    parts += [f"{name} {logs[key]:{fmt}}" for key, name, fmt in STEP_LINE if _jsonable(logs.get(key))]
    if _jsonable(logs.get("learning_rate")):
        parts.append(f"learning rate {logs['learning_rate']:.2e}")
    parts += [f"{logs.get('tokens_per_s', 0):.0f} tok/s", f"lag {logs.get('async_lag', 0):.0f}"]
    per_env = [f"{k[len('reward/') :]} {v:.3f}" for k, v in sorted(logs.items()) if k.startswith("reward/")]
    if per_env:  # several environments: each one's reward
        parts.append(f"({', '.join(per_env)})")
    return "  ".join(parts)


class RichProgressCallback(TrainerCallback):
    """A progress bar with the step's line (`step_line`), and a sample prompt/completion/reward every logging step."""

    def __init__(self, trainer=None):
        self.trainer = trainer
        self.progress = None
        self.task = None

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]RL"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            refresh_per_second=2,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=state.max_steps, completed=state.global_step, info="")

    def on_step_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.update(self.task, completed=state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.progress is None or not logs:
            return
        if "reward" in logs:
            info = step_line(logs)
            self.progress.update(self.task, info=info)
            if not self.progress.console.is_terminal:  # a log file (SLURM, nohup, CI) gets no live bar: one line a step
                self.progress.console.print(f"step {state.global_step}/{state.max_steps}  {info}", soft_wrap=True)
            if self.trainer is not None and args.log_completions:
                self._sample_panel(logs)
        elif any(k.endswith("/reward") for k in logs):
            key = next(k for k in logs if k.endswith("/reward"))
            self.progress.console.print(f"[bold green]{key}[/] = {logs[key]:.4f} (step {state.global_step})")

    def _sample_panel(self, logs):
        rollouts = self.trainer.runtime.last_rollouts
        if not rollouts:
            return
        from rich.panel import Panel

        r = rollouts[0]
        body = f"[dim]{r.prompt_text[-400:]}[/]\n\n{r.completion_text[:600]}\n\n[bold]reward[/] {r.reward:.3f}"
        self.progress.console.print(Panel(body, title=f"step {self.trainer.state.global_step}", expand=False))
        _log_wandb_table(self.trainer, rollouts)

    def on_train_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _log_wandb_table(trainer, rollouts) -> None:
    if "wandb" not in (trainer.args.report_to or []):
        return
    try:
        import wandb
    except ImportError:
        return
    if wandb.run is None:
        return
    rows = [[trainer.state.global_step, r.prompt_text, r.completion_text, r.reward] for r in rollouts]
    table = wandb.Table(
        columns=["step", "prompt", "completion", "reward"], data=rows[: trainer.args.num_completions_to_log]
    )
    # no explicit step: transformers' WandbCallback logs on wandb's own step counter with train/global_step as the
    # x-axis, and a row logged at an explicit step behind that counter is dropped
    wandb.log({"completions": table, "train/global_step": trainer.state.global_step})
