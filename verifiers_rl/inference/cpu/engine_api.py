"""What the CPU server needs from an engine (`ServingEngine`), and the defaults every CPU engine shares.

Two engines implement it: `slot_engine.SlotEngine` (ours, Llama-family models) and `cb_engine.CPUEngine`
(transformers' continuous batching, every other architecture). The HTTP app, the weight receiver and the tests
only speak this interface.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from verifiers_rl.inference.cpu.sampling import Completion, SamplingParams

# Context limit of a CPU server started without --max-model-len (prompt + completion tokens).
DEFAULT_MAX_MODEL_LEN = 4096
# Sequences decoded together (the CPU engines' batch), unless --max-num-seqs says otherwise.
DEFAULT_MAX_NUM_SEQS = 64


class EngineError(RuntimeError):
    """One request failed inside the engine (the server answers 500 for it and keeps serving)."""


class ServingEngine(Protocol):
    model: torch.nn.Module
    tokenizer: object
    max_model_len: int
    version: int  # the policy version being served; set only by a finished sync or /update_weight_version

    @property
    def healthy(self) -> bool: ...

    @property
    def is_paused(self) -> bool: ...

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[Completion]: ...

    def abort_all(self) -> int: ...

    async def wait_idle(self, poll_s: float = 0.01) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, lora_scaling: float | None = None, write=None
    ) -> int: ...

    def finish_update(self, version: int | None = None) -> int: ...

    def placement(self, bucket) -> list[torch.Tensor] | None: ...  # where each of a bucket's tensors belongs

    def weight_checksums(self, metas) -> list[int]: ...  # what the engine holds, for a sync's report

    def reset_prefix_cache(self) -> None: ...

    def close(self) -> None: ...
