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

from verifiers_rl.config.choices import Engine
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
        if engine == Engine.CPU:
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


def assign_gpus(available: int, n_inf: int, n_tr: int, tp: int = 1) -> GpuPlan:
    """GPUs of the server (`n_inf`, [inference] gpus; 0 shares the trainer's first) and of the trainer (`n_tr`),
    inference first; `tp`: vLLM's tensor-parallel size, so the server runs n_inf / tp data-parallel replicas."""
    if available == 0:
        return GpuPlan(0, [], [])
    if n_inf == 0 or (available == 1 and n_inf + n_tr == 2):  # one GPU: a first-class layout, not an error
        if n_tr > available:
            raise ConfigError(f"trainer.gpus={n_tr} exceeds the {available} visible CUDA devices")
        return GpuPlan(available, [0], list(range(max(n_tr, 1))), shared=True)
    if n_inf + n_tr > available:
        raise ConfigError(
            f"inference.gpus={n_inf} + trainer.gpus={n_tr} exceeds the {available} visible CUDA devices "
            "(NCCL weight sync needs separate GPUs for the server and the trainer)"
        )
    if tp < 1 or n_inf % tp:
        raise ConfigError(
            f"inference.gpus={n_inf} is not a multiple of tensor_parallel_size={tp} ([inference.args]): "
            "vLLM runs gpus / tensor_parallel_size data-parallel replicas"
        )
    return GpuPlan(available, list(range(n_inf)), list(range(n_inf, n_inf + n_tr)), n_inf // tp, tp)
