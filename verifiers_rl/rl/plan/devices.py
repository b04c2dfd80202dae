"""Which CUDA devices the inference server and the trainer get, and how the server spreads over its own.

Inference first, then the trainer. `[inference] gpus = N` runs vLLM data-parallel over N / tp replicas of
tensor-parallel size tp (`[inference.args] tensor_parallel_size`), as upstream `vf-rl` did; the weight sync
reaches every DP x TP worker (the server reports its world size). With one visible GPU, or
`[inference] gpus = 0`, the server shares the trainer's first GPU: vLLM gets the memory the planner leaves
it (`memory.py`), weights travel through host memory (gloo; NCCL cannot put two ranks on one device),
and LoRA runs sync adapters by default.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from verifiers_rl.errors import ConfigError


@dataclasses.dataclass
class GpuPlan:
    cuda: int
    inference: list[int]
    trainer: list[int]
    data_parallel: int = 1
    tensor_parallel: int = 1
    shared: bool = False  # the server runs on the trainer's (first) GPU

    def describe(self, engine: str = "vllm") -> str:
        if not self.cuda:
            return "no CUDA devices: CPU engine for inference, trainer on CPU"
        if engine == "cpu":
            return f"{self.cuda} CUDA device(s): trainer on {self.trainer}; the CPU engine serves on the CPU (no GPU)"
        if self.shared:
            gpu = self.inference[0]
            return f"{self.cuda} CUDA device(s): inference shares GPU {gpu} with the trainer on {self.trainer}"
        split = ""
        if self.data_parallel > 1 or self.tensor_parallel > 1:
            split = f" (vLLM data parallel {self.data_parallel} x tensor parallel {self.tensor_parallel})"
        return (
            f"{self.cuda} CUDA devices: inference on {self.inference or 'none'}{split}, "
            f"trainer on {self.trainer or 'none'}"
        )

    @property
    def trainer_processes(self) -> int:
        return max(len(self.trainer), 1)


def visible_devices() -> list[str] | None:
    """This process's CUDA_VISIBLE_DEVICES as a list (indices, UUIDs or MIG ids); None when unset (every GPU)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [d.strip() for d in value.split(",") if d.strip()]


def child_visible_devices(indices: Sequence[int]) -> str:
    """CUDA_VISIBLE_DEVICES for a child process that must see `indices` of THIS process's visible GPUs.

    Every GPU index in a plan (`[inference] gpus`, `server_gpus`, the trainer's GPUs) counts this process's
    visible devices. A child's CUDA_VISIBLE_DEVICES replaces its parent's rather than narrowing it, so index i
    becomes the parent's i-th entry: under CUDA_VISIBLE_DEVICES=2,3 the plan's GPU 1 is physical GPU 3."""
    parent = visible_devices()
    if parent is None:
        return ",".join(str(int(i)) for i in indices)
    missing = [i for i in indices if not 0 <= int(i) < len(parent)]
    if missing:
        raise ConfigError(
            f"GPU index {missing[0]} is not among this process's CUDA_VISIBLE_DEVICES={','.join(parent)} "
            f"(indices count the visible devices, from 0 to {len(parent) - 1})"
        )
    return ",".join(parent[int(i)] for i in indices)


def gpu_uuids(indices: Sequence[int]) -> tuple[str, ...] | None:
    """The UUIDs of `indices` (this process's visible GPUs), or None without CUDA: they name a GPU the same way
    in every process, whatever each one's CUDA_VISIBLE_DEVICES."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return tuple(str(torch.cuda.get_device_properties(int(i)).uuid) for i in indices)
    except Exception:  # noqa: BLE001 - a broken CUDA setup: nothing to compare
        return None


def planned_uuids(indices: Sequence[int], real: bool) -> tuple[str, ...]:
    """GPU names for a plan: the UUIDs on this machine (`real`), else, planning for GPUs it does not have
    (`vf-rl --dry-run --gpus N`), their indices, which are one namespace there."""
    found = gpu_uuids(indices) if real else None
    return found if found is not None else tuple(f"cuda:{int(i)}" for i in indices)


def assign_gpus(cfg: dict[str, Any], available: int) -> GpuPlan:
    if available == 0:
        return GpuPlan(0, [], [])
    n_inf = cfg.get("inference", {}).get("gpus", 1)
    n_tr = cfg.get("trainer", {}).get("gpus", 1)
    if n_inf == 0 or (available == 1 and n_inf + n_tr == 2):  # one GPU: a first-class layout, not an error
        if n_tr > available:
            raise ConfigError(f"trainer.gpus={n_tr} exceeds the {available} visible CUDA devices")
        return GpuPlan(available, [0], list(range(max(n_tr, 1))), shared=True)
    if n_inf + n_tr > available:
        raise ConfigError(
            f"inference.gpus={n_inf} + trainer.gpus={n_tr} exceeds the {available} visible CUDA devices "
            "(NCCL weight sync needs separate GPUs for the server and the trainer)"
        )
    tp = int(cfg.get("inference", {}).get("args", {}).get("tensor_parallel_size", 1))
    if tp < 1 or n_inf % tp:
        raise ConfigError(
            f"inference.gpus={n_inf} is not a multiple of inference.args.tensor_parallel_size={tp}: "
            "vLLM runs gpus / tensor_parallel_size data-parallel replicas"
        )
    return GpuPlan(available, list(range(n_inf)), list(range(n_inf, n_inf + n_tr)), n_inf // tp, tp)


def plan_memory(cfg: dict[str, Any], args, model: str, gpu_bytes: int, base: str | None = None):
    """The shared GPU's split (memory.py) for this run; ConfigError when the model's shape is unknown
    or the two do not fit. `base`: where the shape comes from while `model` does not exist yet (an SFT
    warm-start's output has its base model's shape)."""
    from verifiers_rl.rl.plan.memory import ModelShape, plan_shared_gpu, shape_of

    shape = shape_of(model) or (shape_of(base) if base else None)
    if shape is None and cfg.get("model") == "tiny":
        from verifiers_rl.tiny import TinySpec, build_config, build_tokenizer

        shape = ModelShape.from_config(build_config(build_tokenizer(), TinySpec(**cfg.get("tiny", {}))))
    if shape is None:
        raise ConfigError(
            f"cannot plan one GPU for {model!r}: its config.json is not available here; set "
            "[inference.args] gpu_memory_utilization yourself (the fraction of the GPU vLLM may use)"
        )
    try:
        return plan_shared_gpu(
            shape,
            gpu_bytes,
            use_lora=args.use_lora,
            lora_rank=args.lora_rank,
            micro_batch_tokens=args.token_budget,
            max_seq_len=args.max_seq_len,
            gradient_checkpointing=bool(args.activation_checkpointing),
        )
    except ValueError as e:
        raise ConfigError(f"one GPU: {e}") from None
