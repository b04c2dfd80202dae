"""A `gloo` weight-transfer backend for real vLLM, so a CPU trainer (or a GPU box without a spare GPU for NCCL)
can push weights into vLLM over the protocol our CPU engine speaks. vLLM calls `register` (the
`vllm.general_plugins` entry point) in every process; it names the engine by module path (gloo_engine.py), which
only the workers import. Nothing here imports vLLM at module level.
"""

from __future__ import annotations

import contextlib

BACKEND_NAME = "gloo"
ENGINE = ("verifiers_rl.inference.vllm.gloo_engine", "GlooWeightTransferEngine")


def worker_rank(parallel_config) -> int:
    """This worker's rank among all inference ranks (TP x PP x DP), the numbering of vLLM's NCCL backend. Only
    `data_parallel_index` tells DP engines apart: for dense models vLLM resets each engine's workers to
    data_parallel_rank 0, which would give every engine the same gloo ranks."""
    dp_index = getattr(parallel_config, "data_parallel_index", None)
    if dp_index is None:
        raise RuntimeError(
            "this vLLM's parallel config has no data_parallel_index, so workers of different data-parallel "
            "engines cannot be numbered apart; use vLLM >= 0.32"
        )
    return int(dp_index) * parallel_config.world_size + parallel_config.rank


def register() -> None:
    """`vllm.general_plugins` entry point: make `--weight-transfer-config '{"backend": "gloo"}'` resolvable."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # vLLM calls plugins once per process, but several processes can share one interpreter's modules
    # (in-process engine core) and the factory raises on a second registration.
    if BACKEND_NAME in WeightTransferEngineFactory._registry:
        return
    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, *ENGINE)
