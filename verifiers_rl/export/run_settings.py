"""Whether a rerun resumes, decided from what the checkpoint was trained with.

Every checkpoint's run record (`vf_rl_run.json`) holds `settings`: the model, the environment and the RLConfig
fields that shape what a step computes (optimizer, schedule, LoRA, batch, loss, sampling). A rerun into the same
output_dir compares them with its own before anything starts (`vf-rl --dry-run` prints the outcome):

- same settings: it resumes, and says so;
- changed settings: it stops with one line naming each changed key, both values, and the three ways on (a new
  run_name / output_dir, `on_settings_change = "continue"`, `on_settings_change = "restart"`);
- the checkpoint is at max_steps: the run is finished, nothing trains.

Without this, transformers' resume loads the optimizer and scheduler state, whose learning rate is the old one,
while the run record and the model card name the new one. Pure Python (no torch): the plan runs it before torch
loads.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# not from card.py: it imports transformers (through reward_curve), and vf-rl's plan reads this before anything is
# loaded (a config typo is reported in under 2 s)
from verifiers_rl.export.checkpoints import RUN_INFO, STAGING, _incomplete, checkpoints

# RLConfig fields that change what a step computes: a run that changes one midway is a different run
SHAPING = (
    "learning_rate",
    "lr_scheduler_type",
    "lr_scheduler_kwargs",
    "warmup_steps",
    "warmup_ratio",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "optim",
    "optim_args",
    "max_grad_norm",
    "use_lora",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "lora_modules_to_save",
    "lora_use_rslora",
    "batch_size",
    "rollouts_per_example",
    "num_iterations",
    "loss_type",
    "epsilon",
    "epsilon_high",
    "kl_beta",
    "scale_rewards",
    "max_tokens",
    "max_seq_len",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
)
# the checkpoint's weights or optimizer state do not fit a run that changed one of these: it cannot continue
STRUCTURAL = ("model", "use_lora", "lora_rank", "lora_target_modules", "lora_modules_to_save", "optim")
# an optimizer group's values a continued run takes from its own settings, not from the checkpoint
FRESH_KEYS = ("initial_lr", "weight_decay", "betas", "eps")


def _plain(value: Any) -> Any:
    """A value as JSON holds it (enums by their value, tuples as lists), so a record and a live run compare."""
    value = getattr(value, "value", value)
    return json.loads(json.dumps(value, default=str))


def model_identity(model: str | None) -> str | None:
    """A local model folder by its absolute path (two spellings of one folder are one model); a hub id as is."""
    if model and os.path.isdir(model):
        return os.path.abspath(model)
    return model


def env_identity(table: Any = None, env: Any = None) -> Any:
    """The environment(s) as a config names them ({"id", "args"}, a list of those with ratios), or, for a Python
    run, as the loaded environment records its own id and arguments."""
    if table is not None:
        if isinstance(table, list):
            return [env_identity(e) for e in table]
        out = {"id": table.get("id"), "args": dict(table.get("args") or {})}
        if "ratio" in table:
            out["ratio"] = table["ratio"]
        return _plain(out)
    return _plain({"id": getattr(env, "env_id", None) or None, "args": dict(getattr(env, "env_args", None) or {})})


def run_settings(args, model: str | None, env: Any) -> dict[str, Any]:
    """What shapes this run's training: the model, the environment (`env_identity`) and the SHAPING fields."""
    out = {"model": model_identity(model), "env": env}
    out.update({name: _plain(getattr(args, name, None)) for name in SHAPING})
    return out


def changes(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, recorded value, current value) for every setting that differs; keys one side lacks are skipped (a
    checkpoint written before a field existed)."""
    return [(k, old[k], new[k]) for k in new if k in old and old[k] != new[k]]


def describe(changed: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{k} {json.dumps(a)} -> {json.dumps(b)}" for k, a, b in changed)


@dataclass
class Resume:
    """What a (re)run into output_dir does: "new", "resume", "finished", "restart" or "changed" (it stops)."""

    kind: str
    output_dir: str
    checkpoint: str | None = None
    step: int = 0
    max_steps: int = 0
    changed: list[tuple[str, Any, Any]] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)  # earlier continued changes, from the checkpoint's record
    unchecked: bool = False  # the checkpoint records no settings (written by an older version)

    def line(self) -> str:
        """One line for the plan, the resume notice or the error."""
        where = os.path.abspath(self.output_dir)
        if self.kind == "new":
            return f"a new run in {where}"
        if self.kind == "restart":
            return (
                f'starts {where} over (on_settings_change = "restart"; changed: {describe(self.changed)}): '
                "its checkpoints and metrics are removed"
            )
        if self.kind == "finished":
            return (
                f"{where} is finished: {Path(self.checkpoint).name} is step {self.step} of max_steps {self.max_steps}, "
                "nothing to train (raise max_steps to train on, or set a new run_name / output_dir for a new run)"
            )
        if self.kind == "changed":
            return self._changed_line()
        return f"resumes from {self.checkpoint} (step {self.step} of {self.max_steps}) {self.how()}"

    def how(self) -> str:
        """With which settings a resume goes on."""
        if self.unchecked:
            return f"(its {RUN_INFO} records no settings to compare: written by an older verifiers-rl)"
        if self.changed:
            return f'with new values (on_settings_change = "continue"): {describe(self.changed)}'
        return "with the settings it was trained with"

    def _changed_line(self) -> str:
        structural = [k for k, _, _ in self.changed if k in STRUCTURAL]
        go_on = (
            f'on_settings_change = "continue" cannot ({", ".join(structural)} changed: the checkpoint does not fit)'
            if structural
            else 'on_settings_change = "continue" (resume it with the new values)'
        )
        return (
            f"{self.checkpoint} was trained with other settings: {describe(self.changed)}; choose one: a new run_name "
            f'(or output_dir) for a new run, {go_on}, or on_settings_change = "restart" (start over: removes its '
            "checkpoints and metrics)"
        )

    @property
    def stops(self) -> bool:
        return self.kind == "changed"


def newest_whole(output_dir: str | os.PathLike, requested: Any = True) -> Path | None:
    """The checkpoint a resume starts from when it is whole: `requested` when it is a path, else the newest whose
    save completed (the resume itself still checks it fully and falls back, checkpoints.resume_point)."""
    if requested not in (True, None) and str(requested).strip():
        return Path(requested)
    return next((p for p in checkpoints(output_dir) if _incomplete(p) is None), None)


def read_record(checkpoint: str | os.PathLike) -> dict:
    try:
        return json.loads((Path(checkpoint) / RUN_INFO).read_text())
    except (OSError, ValueError):
        return {}


def decide(output_dir, settings: dict, max_steps: int, policy: str = "stop", requested: Any = True) -> Resume:
    """What a run with `settings` does in `output_dir`: see the module docstring."""
    found = newest_whole(output_dir, requested) if requested else None
    if found is None:
        return Resume("new", str(output_dir), max_steps=max_steps)
    record = read_record(found)
    step = int(record.get("step", found.name.rsplit("-", 1)[-1]))
    resume = Resume("resume", str(output_dir), str(found), step, max_steps, history=record.get("settings_changes", []))
    old = record.get("settings")
    if old is None:
        resume.unchecked = True
        return resume
    resume.changed = changes(old, settings)
    if resume.changed and policy == "restart":
        resume.kind = "restart"
    elif resume.changed and (policy != "continue" or any(k in STRUCTURAL for k, _, _ in resume.changed)):
        resume.kind = "changed"
    elif step >= max_steps:
        resume.kind = "finished"
    return resume


# what a run writes into output_dir (besides logs/): a restart removes exactly these
RUN_OUTPUTS = ("metrics.jsonl", "final", "reward_curve.png", "summary.json", STAGING)


def start_over(output_dir: str | os.PathLike) -> list[str]:
    """on_settings_change = "restart": remove the old run's checkpoints and outputs (nothing else in the folder)."""
    root = Path(output_dir)
    removed = []
    for path in [*checkpoints(root), *(root / name for name in RUN_OUTPUTS)]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(path.name)
    return removed


def settings_history(resume: Resume | None) -> list[dict]:
    """The run record's `settings_changes`: earlier ones, plus this resume's when it continued with new values."""
    if resume is None:
        return []
    history = list(resume.history)
    if resume.kind == "resume" and resume.changed:
        history.append({"step": resume.step, "changes": {k: [a, b] for k, a, b in resume.changed}})
    return history


def optimizer_values(optimizer, scheduler) -> tuple[list[dict], list[float]]:
    """The values a freshly built optimizer and scheduler hold from this run's settings (before a resume loads the
    checkpoint's state over them)."""
    groups = [{k: g[k] for k in FRESH_KEYS if k in g} for g in optimizer.param_groups]
    return groups, list(getattr(scheduler, "base_lrs", []) or [])


def take_new_values(optimizer, scheduler, fresh: tuple[list[dict], list[float]]) -> None:
    """A continued run's own optimizer values win over the ones the checkpoint's state restored (transformers'
    resume keeps the old learning rate otherwise: its scheduler state holds base_lrs); the moments stay."""
    groups, base_lrs = fresh
    for group, values in zip(optimizer.param_groups, groups, strict=False):
        group.update(values)
    if scheduler is None or not base_lrs:
        return
    scheduler.base_lrs = list(base_lrs)
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas:  # LambdaLR (every transformers schedule): the rate at the restored step, from the new base
        for group, base, fn in zip(optimizer.param_groups, base_lrs, lambdas, strict=False):
            group["lr"] = base * fn(scheduler.last_epoch)
        scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
