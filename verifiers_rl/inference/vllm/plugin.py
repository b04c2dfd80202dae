"""A `gloo` weight-transfer backend for real vLLM, so a CPU trainer (or a GPU box without a spare GPU for NCCL)
can push weights into a running vLLM server over the same bucketed wire protocol our own CPU engine speaks.

vLLM discovers it through the `vllm.general_plugins` entry point (`register`, pyproject.toml), which it calls in
the API server, the engine core and every worker. `register` names the engine by module path
(gloo_engine.py): vLLM's factory imports it on first use, which only the workers do. Start vLLM with
`--weight-transfer-config '{"backend": "gloo"}'` and `VLLM_SERVER_DEV_MODE=1`.

Nothing here imports vLLM at module level: `register` imports vLLM's factory when vLLM calls it.
"""

from __future__ import annotations

import contextlib

BACKEND_NAME = "gloo"
ENGINE = ("verifiers_rl.inference.vllm.gloo_engine", "GlooWeightTransferEngine")


def worker_rank(parallel_config) -> int:
    """This worker's rank among all inference ranks (TP x PP x DP), the numbering of vLLM's NCCL backend.

    Only `data_parallel_index` tells DP engines apart: for dense models vLLM resets each engine's workers to
    data_parallel_rank 0 and data_parallel_size 1, so falling back to those would give every engine the same
    gloo ranks and the group would never form."""
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
