"""GPU weight sync: vLLM's own trainer-side NCCL engine (packed broadcast), driven through our client.

Everything vLLM-specific is imported lazily: this module loads without vLLM, and only `NCCLSender.init`
needs it. NCCL needs the trainer and the server on different GPUs (it cannot put two ranks on one device).
NOT exercised on CPU machines: CI covers the control adapter against our server; the NCCL data path runs
only where vLLM and CUDA are present.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from verifiers_rl.rl.inference.transfer.buckets import DEFAULT_BUCKET_BYTES


class SyncControl:
    """vLLM's `VLLMWeightSyncClient` protocol (four methods, plain dicts) over our authenticated client, so
    vLLM's trainer engine sends our control token and the weight version we choose."""

    def __init__(self, client):
        self.client = client
        self.next_version: int | None = None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.client._post("/init_weight_transfer_engine", json={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.client._post("/start_weight_update")

    def update_weights(self, update_info) -> None:
        self.client._post("/update_weights", json={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is None and self.next_version is not None:
            weight_version = str(self.next_version)
        self.client._post("/finish_weight_update", json={"weight_version": weight_version})


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
    def __init__(self, client, *, host: str, port: int, world_size: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.control = SyncControl(client)
        self.host, self.port, self.world_size = host, port, world_size
        self.bucket_bytes = bucket_bytes
        self._items: list[tuple[str, torch.Tensor]] = []
        self.engine = None

    def init(self) -> NCCLSender:
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
            master_port=self.port,
            world_size=self.world_size,
            packed=True,
            packed_buffer_size_bytes=self.bucket_bytes,
        )
        source = _named_tensor_source(lambda: self._items)
        self.engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=self.control, source=source)
        return self

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> tuple[int, int]:
        """Broadcast one sync; returns (tensors, bytes). The caller pauses/resumes around it."""
        device = torch.device("cuda", torch.cuda.current_device())
        self._items = [(n, t.to(device, non_blocking=True)) for n, t in named_tensors]
        self.control.next_version = version
        try:
            self.engine.send_weights()  # start -> update_weights ‖ packed broadcast -> finish
        finally:
            n, nbytes = len(self._items), sum(t.numel() * t.element_size() for _, t in self._items)
            self._items = []
        return n, nbytes

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
