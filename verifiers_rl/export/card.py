"""The model card of an exported model (`README.md`, with `reward_curve.png` beside it): what it was trained from,
on which environment, with which settings, how it scored before and after, and how to serve and evaluate it.

Everything on it comes from the run's log history (`TrainerState.log_history`, also in every checkpoint's
trainer_state.json) and the run facts the trainer records (`vf_rl_run.json`), so a card written at the end of a
run and one written later by `vf-rl export` from a checkpoint say the same things.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from verifiers_rl.export.checkpoints import RUN_INFO  # noqa: F401 - its name here too
from verifiers_rl.export.reward_curve import has_rewards, read_metrics, save_reward_curve

CURVE = "reward_curve.png"


def run_history(output_dir: str | os.PathLike, step: int, log_history: list[dict]) -> list[dict]:
    """The run's log lines up to `step`: its metrics.jsonl, which also holds the evaluations made before train()
    started (Trainer starts a fresh log history in train()), else the trainer's log history."""
    rows = [r for r in read_metrics(output_dir) if r.get("step", 0) <= step]
    return rows or [r for r in log_history if r.get("step", 0) <= step]


def eval_rows(log_history: list[dict]) -> list[dict]:
    """One row per logged evaluation: its name (the metric prefix), step, reward and rollouts."""
    out = []
    for row in log_history:
        for key, value in row.items():
            if key.startswith("eval") and key.endswith("/reward"):
                name = key[: -len("/reward")]
                out.append(
                    {"name": name, "step": row.get("step"), "reward": value, "rollouts": row.get(f"{name}/rollouts")}
                )
    return out


def _hub_id(name: str | None) -> bool:
    """A hub model id ("org/name"), not a local folder: only those belong in the card's `base_model` metadata (the
    hub rejects a card whose base_model is a path)."""
    return bool(name) and not os.path.exists(name) and name.count("/") == 1 and not name.startswith((".", "/", "~"))


@dataclass
class ModelCard:
    step: int
    kind: str  # what the folder holds: "merged+adapter", "merged" or "adapter"
    base_model: str | None = None
    env_id: str | None = None
    env_args: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    log_history: list[dict] = field(default_factory=list)
    title: str = "RL-trained model"
    settings_changes: list[dict] = field(default_factory=list)  # from vf_rl_run.json

    @classmethod
    def from_run(cls, info: dict, *, run_dir: str | os.PathLike | None = None, **kwargs) -> ModelCard:
        """From the facts in vf_rl_run.json (missing ones stay empty); with `run_dir`, the log history is the run's
        up to `step` (`run_history`: its metrics.jsonl, else the `log_history` given)."""
        if run_dir is not None:
            kwargs["log_history"] = run_history(run_dir, kwargs["step"], kwargs.get("log_history") or [])
        keys = ("base_model", "env_id", "env_args", "config", "settings_changes")
        return cls(**{k: info[k] for k in keys if info.get(k) is not None}, **kwargs)

    def write(self, folder: str | os.PathLike) -> None:
        folder = Path(folder)
        evals = {r["name"]: r["reward"] for r in eval_rows(self.log_history)}
        curve = save_reward_curve(
            [r for r in self.log_history if "step" in r],
            folder / CURVE,
            before=evals.get("eval_before"),
            after=evals.get("eval_after"),
            title=self.title,
        )
        (folder / "README.md").write_text(self.render(curve is not None))

    def _metadata(self) -> str:
        from huggingface_hub import ModelCardData

        data = ModelCardData(
            base_model=self.base_model if _hub_id(self.base_model) else None,
            library_name="peft" if self.kind == "adapter" else "transformers",
            pipeline_tag="text-generation",
            tags=["verifiers-rl", "verifiers", "reinforcement-learning", *([self.env_id] if self.env_id else [])],
        )
        return f"---\n{data.to_yaml()}\n---\n"

    def render(self, with_curve: bool | None = None) -> str:
        with_curve = has_rewards(self.log_history) if with_curve is None else with_curve
        base = f"`{self.base_model}`" if self.base_model else "its base model"
        env = f"the `{self.env_id}` environment" if self.env_id else "a verifiers environment"
        parts = [
            self._metadata(),
            f"# {self.title}\n",
            f"{base} trained with reinforcement learning (group-relative advantages, verifiers-rl) on {env}, "
            f"{self.step} optimizer steps.\n",
            "## Files\n",
            *self._files(),
            "## Evaluation\n",
            *self._evals(),
        ]
        if with_curve:
            parts += ["## Reward curve\n", f"![reward curve]({CURVE})\n"]
        parts += ["## Use it\n", *self._usage()]
        if self.config:
            parts += ["## Training configuration\n", "```json", json.dumps(self.config, indent=2, default=str), "```\n"]
        for change in self.settings_changes:  # a run continued with new values (on_settings_change = "continue")
            values = ", ".join(f"`{k}` {json.dumps(a)} -> {json.dumps(b)}" for k, (a, b) in change["changes"].items())
            parts.append(f"From step {change['step']} on, this run trained with new values: {values}.\n")
        return "\n".join(parts)

    def _files(self) -> list[str]:
        if self.kind == "adapter":
            return [
                f"- the LoRA adapter (peft: `adapter_config.json`, `adapter_model.safetensors`) for {self.base_model}\n"
            ]
        lines = ["- the model (`config.json`, `model*.safetensors`, tokenizer and chat template, generation config)"]
        if self.kind == "merged+adapter":
            lines[0] += ", with the LoRA adapter merged into its weights"
            lines.append("- `adapter/`: the LoRA adapter on its own (peft), for the base model named above")
        return [*lines, ""]

    def _evals(self) -> list[str]:
        rows = eval_rows(self.log_history)
        if not rows:
            return ["No evaluation was logged during this run.\n"]
        lines = ["| eval | step | reward | rollouts |", "|---|---|---|---|"]
        for r in rows:
            n = "" if r["rollouts"] is None else f"{r['rollouts']:.0f}"
            lines.append(f"| {r['name']} | {r['step']} | {r['reward']:.4f} | {n} |")
        return [*lines, ""]

    def _usage(self) -> list[str]:
        env_args = f" -a '{json.dumps(self.env_args)}'" if self.env_args else ""
        env = self.env_id or "ENV"
        if self.kind == "adapter":
            return [
                "```python",
                "from peft import PeftModel",
                "from transformers import AutoModelForCausalLM",
                "",
                f'base = AutoModelForCausalLM.from_pretrained("{self.base_model}")',
                'model = PeftModel.from_pretrained(base, "MODEL_DIR")  # MODEL_DIR: this folder',
                "```\n",
            ]
        return [
            "Serve it (vLLM on a GPU; `--engine cpu` runs the built-in CPU engine) and evaluate it with verifiers'",
            "`vf-eval`, where MODEL_DIR is this folder:\n",
            "```bash",
            "vf-vllm --model MODEL_DIR --port 8000",
            f"vf-eval {env} -m MODEL_DIR -b http://127.0.0.1:8000/v1{env_args} -n 20 -r 1",
            "```\n",
            "or load it with transformers: `AutoModelForCausalLM.from_pretrained(MODEL_DIR)`.\n",
        ]
