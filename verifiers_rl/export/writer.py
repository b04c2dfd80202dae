"""A trained model written as a folder anyone can load, serve and share.

    OUT/              config.json, generation_config.json, model*.safetensors (LoRA merged into the weights),
                      tokenizer files, chat_template.jinja, README.md (model card), reward_curve.png,
                      vf_rl_run.json (base model, environment, config), vf_rl_export.json (written last)
    OUT/adapter/      adapter_config.json, adapter_model.safetensors: the LoRA adapter on its own

`kind` "merged+adapter" (the default for a LoRA model) writes both; "merged" leaves out `adapter/`; "adapter" puts
the adapter files at the top instead of merged weights. A fully fine-tuned model is written as it is.

The merge is out of place (`policy_weights.merged_weights`: base + LoRA delta in float32, cast back), so exporting
in the middle of a run never moves the trainer's weights. The folder is written beside OUT and renamed into place
once complete (`checkpoints.publish`): a crash mid-export leaves a `.OUT.staging` folder, never an OUT that looks
whole.

Sharded layouts plug in through `weights`: the merged (name, tensor) pairs, which a sharded trainer's rank 0 reads
from its `WeightExport.stream("merged")` (a walk every rank joins); `adapter_state` likewise, from
`stream("adapter_state")`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from verifiers_rl.export.card import RUN_INFO, ModelCard
from verifiers_rl.export.checkpoints import publish, write_manifest
from verifiers_rl.sync.policy_weights import merged_weights

FINAL_DIR = "final"
ADAPTER_DIR = "adapter"
EXPORT_MANIFEST = "vf_rl_export.json"
KINDS = ("merged+adapter", "merged", "adapter")


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def check_kind(kind: str, lora: bool) -> None:
    if kind not in KINDS:
        raise ValueError(f"export kind={kind!r}; allowed: {', '.join(KINDS)}")
    if kind == "adapter" and not lora:
        raise ValueError("an adapter-only export needs a LoRA (peft) model; this one is fully fine-tuned")


def write_merged(model, folder: Path, weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
    """The model's weights with LoRA merged, as transformers' save_pretrained writes a model (safetensors, shards
    and index when large, config, generation config)."""
    inner = model.get_base_model() if is_lora(model) else model
    state = dict(merged_weights(model) if weights is None else weights)
    with _as_one_process(inner), _as_checkpoint(inner.config):
        inner.save_pretrained(folder, state_dict=state)


def checkpoint_use_cache(config) -> bool:
    """`use_cache` as the model's own checkpoint has it (its config.json, when it is a local folder), else as its
    config class defaults it (True for causal LMs)."""
    path = Path(getattr(config, "_name_or_path", "") or "") / "config.json"
    try:
        return bool(json.loads(path.read_text())["use_cache"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        return bool(type(config)().use_cache)
    except Exception:  # noqa: BLE001 - a config class that needs arguments: every causal LM's default
        return True


@contextlib.contextmanager
def _as_checkpoint(config):
    """transformers' Trainer sets the trained model's `config.use_cache` to TrainingArguments.use_cache (False): a
    training setting that, saved, makes a plain `generate()` on the export run without a KV cache."""
    trained = config.use_cache
    config.use_cache = checkpoint_use_cache(config)
    try:
        yield
    finally:
        config.use_cache = trained


@contextlib.contextmanager
def _as_one_process(model):
    """A model FSDP2-sharded at load time carries its DistributedConfig in its config: save_pretrained would then
    gather the shards itself (a collective every rank must join, while only rank 0 writes here) and put the
    training-time sharding into the exported config.json. The weights given are already whole: save them as one
    process would."""
    config = model.config
    sharding = getattr(config, "distributed_config", None)
    if sharding is None:
        yield
        return
    config.distributed_config = None
    try:
        yield
    finally:
        config.distributed_config = sharding


def write_adapter(model, folder: Path, adapter_state: dict | None = None) -> None:
    """The LoRA adapter as peft saves it (loads with `PeftModel.from_pretrained(base, folder)`)."""
    model.save_pretrained(folder, state_dict=adapter_state)
    (folder / "README.md").unlink(missing_ok=True)  # peft's blank template: the export's own card describes it


def export_model(
    model,
    tokenizer,
    out: str | os.PathLike,
    *,
    kind: str = "merged+adapter",
    card: ModelCard | None = None,
    run_info: dict | None = None,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    adapter_state: dict | None = None,
) -> Path:
    """Write `model` (a transformers model or a peft LoRA model, unwrapped) and its tokenizer to `out` (replacing
    what is there), with its model card; returns `out`. One process writes; see the module doc for sharding."""
    out = Path(out)
    lora = is_lora(model)
    check_kind(kind, lora)
    staging = out.parent / f".{out.name}.staging"
    shutil.rmtree(staging, ignore_errors=True)  # an export that was killed
    staging.mkdir(parents=True)
    if kind != "adapter":
        write_merged(model, staging, weights)
    if lora and kind != "merged":
        write_adapter(model, staging if kind == "adapter" else staging / ADAPTER_DIR, adapter_state)
    tokenizer.save_pretrained(staging)
    if run_info is not None:
        (staging / RUN_INFO).write_text(json.dumps(run_info, indent=2, default=str))
    if card is not None:
        card.write(staging)
    step = card.step if card is not None else 0
    write_manifest(staging, step, EXPORT_MANIFEST, kind=kind if lora else "merged")
    publish(staging, out)
    return out


def is_export(folder: str | os.PathLike) -> bool:
    """A complete export (its manifest is written last, inside the staging folder, before the rename)."""
    return (Path(folder) / EXPORT_MANIFEST).exists()
