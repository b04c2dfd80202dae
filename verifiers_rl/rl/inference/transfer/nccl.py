"""GPU weight sync: vLLM's own trainer-side NCCL engine (packed broadcast), driven through our client.

Everything vLLM-specific is imported lazily: this module loads without vLLM, and only `NCCLSender.init`
needs it. NCCL needs the trainer and the server on different GPUs (it cannot put two ranks on one device).
NOT exercised on CPU machines: CI covers the control adapter against our server; the NCCL data path runs
only where vLLM and CUDA are present.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from verifiers_rl.rl.inference.net import free_port
from verifiers_rl.rl.inference.transfer.buckets import DEFAULT_BUCKET_BYTES
from verifiers_rl.rl.inference.transfer.sender import NamedTensors, SyncStats


class SyncControl:
    """vLLM's `VLLMWeightSyncClient` protocol (four methods, plain dicts) over our authenticated client, so
    vLLM's trainer engine sends our control token and the weight version we choose."""

    def __init__(self, client):
        self.client = client
        self.next_version: int | None = None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.client.post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.client.post("/start_weight_update")

    def update_weights(self, update_info) -> None:
        self.client.post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is None and self.next_version is not None:
            weight_version = str(self.next_version)
        self.client.post("/finish_weight_update", {"weight_version": weight_version})


def _named_tensor_source(items: Callable[[], list[tuple[str, torch.Tensor]]]):
    """A vLLM WeightSource whose tensors are whatever `items()` holds for the current sync."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class NamedTensorSource(WeightSource):
        def metadata(self):
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in items()]

        def __iter__(self):
            return iter(items())

    return NamedTensorSource()


class NCCLSender:
    """vLLM's packed NCCL broadcast. The TCP rendezvous port is picked here (NCCL's own store needs one
    before the server is told where it is)."""

    backend = "nccl"

    def __init__(self, client, *, host: str = "127.0.0.1", bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.client = client
        self.control = SyncControl(client)
        self.host = host
        self.bucket_bytes = bucket_bytes
        self._items: list[tuple[str, torch.Tensor]] = []
        self.engine = None

    def init(self) -> None:
        try:
            from vllm.distributed.weight_transfer.nccl_engine import (
                NCCLTrainerInitInfo,
                NCCLTrainerWeightTransferEngine,
            )
        except ImportError as e:
            raise RuntimeError(
                "NCCL weight sync needs vLLM in the trainer's environment (pip install 'verifiers-rl[vllm]'); "
                "on CPU use the gloo backend"
            ) from e
        if not torch.cuda.is_available():
            raise RuntimeError("NCCL weight sync needs a CUDA device in the trainer process; use gloo on CPU")
        info = NCCLTrainerInitInfo(
            master_address=self.host,
            master_port=free_port(self.host),
            world_size=1 + self.client.get_world_size(),
            packed=True,
            packed_buffer_size_bytes=self.bucket_bytes,
        )
        source = _named_tensor_source(lambda: self._items)
        self.engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=self.control, source=source)

    def send(self, named_tensors: NamedTensors, version: int) -> SyncStats:
        t0 = time.perf_counter()
        device = torch.device("cuda", torch.cuda.current_device())
        self._items = [(n, t.to(device, non_blocking=True)) for n, t in named_tensors]
        self.control.next_version = version
        try:
            self.engine.send_weights()  # start -> update_weights ‖ packed broadcast -> finish
            self.client.reset_prefix_cache()
        finally:
            n, nbytes = len(self._items), sum(t.numel() * t.element_size() for _, t in self._items)
            self._items = []
        return SyncStats(time.perf_counter() - t0, nbytes, n, 0, version)

    def close(self, polite: bool = True) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
