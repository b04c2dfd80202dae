"""The end of a run: `<output_dir>/final`, the trained model ready to serve, evaluate and share.

`RLTrainer.train()` calls `save_final` when it finishes (vf-rl calls it after its eval after RL, so the card has
both evaluations); `push_final` sends the folder to the hub (`push_to_hub` / `hub_model_id`). The folder itself is
written by `verifiers_rl.export.writer` (merged out of place, staged and renamed into place). Multi-process runs:
rank 0 writes it inside `RankZeroLeads.run`, reading its weight export's streams, whose walks the other ranks join
under a sharded layout (`ShardedExport.stream`); they return its result, or raise its error.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from verifiers_rl.export.card import RUN_INFO, ModelCard
from verifiers_rl.export.hub import push_folder, repo_name
from verifiers_rl.export.run_settings import settings_history
from verifiers_rl.export.writer import FINAL_DIR, export_model, is_export, is_lora

logger = logging.getLogger(__name__)

# never on a card or in a run record: credentials, and paths of this machine that say nothing about the training
_LEFT_OUT = {"output_dir", "logging_dir", "run_name", "sampling_args", "lora_config", "hub_model_id"}


def _secret(key: str) -> bool:
    key = key.lower()
    return "token" in key or "api_key" in key or "password" in key


def without_secrets(value):
    """A config (nested dicts and lists) with every credential-like key removed."""
    if isinstance(value, dict):
        return {k: without_secrets(v) for k, v in value.items() if not _secret(str(k))}
    if isinstance(value, list):
        return [without_secrets(v) for v in value]
    return value


def config_summary(args) -> dict:
    """The settings a Python run was given that differ from RLConfig's defaults (what makes this run this run)."""
    out = {}
    given = getattr(args, "given_fields", None)
    for f in dataclasses.fields(args):
        if not f.init or f.name in _LEFT_OUT or _secret(f.name) or (given is not None and f.name not in given):
            continue
        default = f.default
        if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        value = getattr(args, f.name)
        if default is dataclasses.MISSING or value == default or value in ([], None) and default in ([], None):
            continue
        out[f.name] = getattr(value, "value", value)
    return out


def run_info(trainer) -> dict:
    """What the run trained, from what, on what: written into checkpoints and exports (vf_rl_run.json)."""
    base = trainer.model_path
    local = base is not None and Path(base).is_dir()
    env = trainer.env
    return {
        "base_model": base,
        "base_model_path": str(Path(base).resolve()) if local else None,
        "env_id": getattr(env, "env_id", None) or None,
        "env_args": without_secrets(dict(getattr(env, "env_args", None) or {})),
        "config": without_secrets(trainer.run_config) if trainer.run_config else config_summary(trainer.args),
        "step": trainer.state.global_step,
        # what a rerun compares before it resumes (run_settings.py), and the values a continued run changed midway
        "settings": without_secrets(trainer.run_settings()),
        "settings_changes": settings_history(trainer.resume_plan),
    }


def write_run_info(trainer, folder) -> None:
    (Path(folder) / RUN_INFO).write_text(json.dumps(run_info(trainer), indent=2, default=str))


def _on_cpu(trainer, kind: str) -> dict:
    """A weight stream's tensors on the CPU (rank 0; a sharded export's are views of buffers it reuses: copies)."""
    export = trainer.weight_export()
    return {name: t.detach().to("cpu", copy=export.collective) for name, t in export.stream(kind)}


def save_final(trainer, *, push: bool = True) -> Path | None:
    """Write <output_dir>/final as `final_model` says (None when it says 'none'), then push it when push_to_hub."""
    args = trainer.args
    if args.final_model == "none":
        return None
    out = Path(args.output_dir) / FINAL_DIR
    model = trainer.accelerator.unwrap_model(trainer.model)
    kind = args.final_model if is_lora(model) else "merged"

    def write() -> None:  # rank 0; the adapter read from the export too (peft's save sees rank 0's shards)
        weights = _on_cpu(trainer, "merged") if kind != "adapter" else None
        adapter = _on_cpu(trainer, "adapter_state") if kind != "merged" else None
        info = run_info(trainer)
        title, step = args.run_name or Path(args.output_dir).name, trainer.state.global_step
        card = ModelCard.from_run(
            info, run_dir=args.output_dir, step=step, kind=kind, log_history=trainer.state.log_history, title=title
        )
        export_model(
            model,
            trainer.processing_class,
            out,
            kind=kind,
            card=card,
            run_info=info,
            weights=weights,
            adapter_state=adapter,
        )
        logger.info("final model: %s (serve it with `vf-vllm --model %s`)", out, out)

    trainer.rank_zero.run(write)
    if push and args.push_to_hub and trainer.is_world_process_zero():
        push_final(trainer, out)
    return out


def push_final(trainer, folder=None, *, commit_message=None, token=None, revision=None, private=None):
    """Upload `folder` (default <output_dir>/final, exported first if it is not there) to the hub repository
    `hub_model_id` (default: the output folder's name), creating it if needed. Rank 0 only."""
    args = trainer.args
    folder = Path(folder) if folder is not None else Path(args.output_dir) / FINAL_DIR
    if not is_export(folder):
        save_final(trainer, push=False)
    if not trainer.is_world_process_zero():
        return None
    return push_folder(
        folder,
        repo_name(args.hub_model_id, args.output_dir),
        token=token if token is not None else args.hub_token,
        private=private if private is not None else args.hub_private_repo,
        revision=revision if revision is not None else args.hub_revision,
        commit_message=commit_message or f"verifiers-rl: {folder.name} at step {trainer.state.global_step}",
    )
