"""Sharded training, configured the way accelerate users configure it.

- **DeepSpeed ZeRO-3**: `accelerate launch --config_file zero3.yaml` (or `TrainingArguments.deepspeed`). Trainer and
  DeepSpeed shard the model; the weight export gathers it for a sync (`weight_export.ZeRO3Export`), and the run's
  precision follows the launcher's (`follow_launcher_precision`).
- **FSDP2**: an accelerate FSDP config with `fsdp_version: 2`, or `TrainingArguments(fsdp=True,
  fsdp_config={"version": 2})`. The model is sharded by transformers itself while it loads
  (`from_pretrained(distributed_config=DistributedConfig(fsdp_size=world))`: `fully_shard` per decoder layer and
  on the embeddings and the head), on GPUs and on CPUs alike, and accelerate is told not to wrap it again
  (`take_over_fsdp`). accelerate would not engage FSDP on a CPU at all (its FSDP plugin needs a GPU), which is why
  the library applies it: the code path a GPU run takes is the one the CPU tests run.
"""

from __future__ import annotations

import os

from verifiers_rl.errors import TrainingError

_TRUE = ("1", "true", "yes")


def fsdp2_requested(args) -> bool:
    """FSDP version 2 asked for by the launcher (accelerate exports ACCELERATE_USE_FSDP and FSDP_VERSION from its
    config) or by `TrainingArguments.fsdp` with `fsdp_config` version 2."""
    launcher = os.environ.get("ACCELERATE_USE_FSDP", "").lower() in _TRUE and os.environ.get("FSDP_VERSION") == "2"
    config = args.fsdp_config or {}
    version = config.get("version", config.get("fsdp_version", 1))
    return launcher or (bool(args.fsdp) and int(version) == 2)


def take_over_fsdp(args) -> None:
    """The model is sharded at load time (`load_sharded`): accelerate and Trainer must not wrap it again, so their
    FSDP settings are cleared (Trainer then treats it as a model that owns its placement and gradient reduction)."""
    os.environ["ACCELERATE_USE_FSDP"] = "false"
    args.fsdp, args.fsdp_config, args.fsdp_plugin_args = [], {}, None


def load_sharded(model_name: str, use_liger: bool = False, model_kwargs: dict | None = None):
    """The model loaded FSDP2-sharded over every process of the run (WORLD_SIZE, set by the launcher)."""
    from transformers.distributed import DistributedConfig

    from verifiers_rl.models import get_model

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        raise TrainingError(
            "FSDP2 shards the model over several processes, but this one runs alone (WORLD_SIZE is unset or 1): "
            "start it with `accelerate launch --num_processes N` or `torchrun --nproc-per-node N`"
        )
    return get_model(
        model_name,
        use_liger=use_liger,
        model_kwargs={**(model_kwargs or {}), "distributed_config": DistributedConfig(fsdp_size=world)},
    )


def sharded_model_error() -> TrainingError:
    return TrainingError(
        "FSDP2 shards the model while it loads: pass RLTrainer(model=<hub id or local path>), or a model loaded with "
        "from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=<processes>))"
    )


def follow_launcher_precision(args) -> None:
    """A run started by `accelerate launch` trains in the launcher's mixed precision (ACCELERATE_MIXED_PRECISION,
    from its config or `--mixed_precision`) unless the config names one itself: the same precision on both sides,
    instead of DeepSpeed's "bf16.enabled=True vs hf bf16=False" refusal at the first step."""
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "").lower()
    if precision in ("bf16", "fp16") and not (args.bf16 or args.fp16):
        setattr(args, precision, True)


# Sizes DeepSpeed takes from its own defaults when a config leaves them out (as accelerate's config built from a
# yaml does): reduce_bucket_size 5e8 elements, more than a small model has. ZeRO-3 then collects every gradient,
# whole, in one bucket before a single reduce-scatter at the end of backward: each rank holds the full model's
# gradients on top of its partition (a higher per-rank peak than DDP's; design_measurements.md#zero-3-bucket-sizes
# in benchmarks/results). HF's "auto" sizes them from the model (hidden² elements per bucket, 0.9 hidden² prefetch,
# 10 hidden persistence threshold), as its example configs do.
ZERO3_SIZES = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")


def size_zero3_buckets_on_cpu(accelerator, device) -> list[str]:
    """On a CPU run under ZeRO-3, the bucket sizes the DeepSpeed config does not name become "auto" (filled by
    Trainer from the model when DeepSpeed starts); returns those it set. A size the config names is kept, and GPU
    runs keep DeepSpeed's own defaults (a larger bucket trades memory for fewer collectives there)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None or getattr(device, "type", "cpu") != "cpu":
        return []
    zero = plugin.hf_ds_config.config.setdefault("zero_optimization", {})
    if int(zero.get("stage", 0)) != 3:
        return []
    missing = [k for k in ZERO3_SIZES if k not in zero]
    for k in missing:
        zero[k] = "auto"
    return missing
