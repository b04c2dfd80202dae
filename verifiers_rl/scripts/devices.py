"""Which CUDA devices the inference server and the trainer get, and how the server spreads over its own.

Inference first, then the trainer. `[inference] gpus = N` runs vLLM data-parallel over N / tp replicas of
tensor-parallel size tp (`[inference.args] tensor_parallel_size`), as upstream `vf-rl` did; the weight sync
reaches every DP x TP worker (the server reports its world size).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from verifiers_rl.scripts.toml_config import ConfigError


@dataclasses.dataclass
class GpuPlan:
    cuda: int
    inference: list[int]
    trainer: list[int]
    data_parallel: int = 1
    tensor_parallel: int = 1

    def describe(self) -> str:
        if not self.cuda:
            return "no CUDA devices: CPU engine for inference, trainer on CPU"
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


def assign_gpus(cfg: dict[str, Any], available: int) -> GpuPlan:
    if available == 0:
        return GpuPlan(0, [], [])
    n_inf = cfg.get("inference", {}).get("gpus", 1)
    n_tr = cfg.get("trainer", {}).get("gpus", 1)
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
