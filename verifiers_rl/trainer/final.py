"""The end of a run: `<output_dir>/final`, the trained model ready to serve, evaluate and share.

`RLTrainer.train()` calls `save_final` when it finishes (vf-rl calls it after its eval after RL, so the card has
both evaluations); `push_final` sends the folder to the hub (`push_to_hub` / `hub_model_id`). The folder itself is
written by `verifiers_rl.export.writer` (merged out of place, staged and renamed into place). Multi-process runs:
every rank produces the merged weights from its weight export (a collective under a sharded layout), rank 0
writes, the others wait for it.
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


def _merged_on_rank0(trainer) -> dict | None:
    """Every rank walks the merged weight stream under a sharded layout (producing it is a collective every rank
    joins); rank 0 keeps the tensors, on the CPU. Replicated, the other ranks skip it: merging LoRA there would be
    wasted work."""
    keep, export = trainer.is_world_process_zero(), trainer.weight_export()
    if not keep and not export.collective:
        return None
    tensors = {}
    for name, tensor in export.stream("merged"):
        if keep:  # a sharded export's tensors are views of buffers it reuses a few buckets later: copies
            tensors[name] = tensor.detach().to("cpu", copy=export.collective)
    return tensors if keep else None


def save_final(trainer, *, push: bool = True) -> Path | None:
    """Write <output_dir>/final as `final_model` says (None when it says 'none'), then push it when push_to_hub."""
    args = trainer.args
    if args.final_model == "none":
        return None
    out = Path(args.output_dir) / FINAL_DIR
    model = trainer.accelerator.unwrap_model(trainer.model)
    kind = args.final_model if is_lora(model) else "merged"
    weights = _merged_on_rank0(trainer) if kind != "adapter" else None
    # the adapter gathered on every rank (a collective under sharding) instead of inside peft's save, on rank 0 only
    adapter = trainer.weight_export().lora_state() if kind != "merged" else None
    try:
        if trainer.is_world_process_zero():
            info = run_info(trainer)
            title = args.run_name or Path(args.output_dir).name
            step = trainer.state.global_step
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
    finally:
        trainer.accelerator.wait_for_everyone()  # a rank-0 failure must not leave the others waiting
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
