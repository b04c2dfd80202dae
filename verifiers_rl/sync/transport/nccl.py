"""GPU weight sync: vLLM's own trainer-side NCCL engine (packed broadcast), driven through our client.

vLLM is imported lazily: only `NCCLSender.init` needs it. NCCL needs the trainer and the server on different GPUs.
The init follows vLLM's `trainer_init` with each stage bounded and named, and each sync runs under a watchdog
(watchdog.py): an NCCL call has no timeout of its own. On CPU machines tests/e2e/test_nccl_sync.py drives
this sender with vLLM's real trainer and worker engines, only CUDA and the NCCL communicator replaced.
"""

from __future__ import annotations

import contextlib
import time

import torch

from verifiers_rl.config.net import LOOPBACK, free_port
from verifiers_rl.sync.buckets import DEFAULT_BUCKET_BYTES
from verifiers_rl.sync.sender import NamedTensors, SyncStats
from verifiers_rl.sync.stream import WeightStream, as_stream
from verifiers_rl.sync.transport.watchdog import BoundedInit, SyncAborted, Watchdog


class SyncControl:
    """vLLM's `VLLMWeightSyncClient` protocol over our authenticated client, so vLLM's trainer engine sends our
    control token and the weight version we choose. Every request of a sync may take as long as the sync itself."""

    def __init__(self, client, timeout_s: float = 300.0):
        self.client = client
        self.timeout_s = timeout_s
        self.next_version: int | None = None
        self.route: str | None = None  # the request of the sync in progress (the watchdog names it)
        self.failure: BaseException | None = None  # the first request of the sync in progress that failed

    def begin(self) -> None:
        self.route, self.failure = None, None

    def _post(self, path: str, body: dict | None = None) -> None:
        self.route = path
        try:
            self.client.post(path, body, timeout=self.timeout_s)
        except Exception as e:
            if self.failure is None:  # read by the watchdog: vLLM's engine would not look before the broadcast ends
                self.failure = e
            raise

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("/start_weight_update")

    def update_weights(self, update_info) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is None and self.next_version is not None:
            weight_version = str(self.next_version)
        self._post("/finish_weight_update", {"weight_version": weight_version})


def _stream_source(sender: NCCLSender):
    """A vLLM WeightSource over the sync in progress, iterated lazily: vLLM's packer pulls (and merges) one
    bucket's tensors at a time instead of a copy of the whole model."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class StreamSource(WeightSource):
        def metadata(self):
            return [ParamMeta(m.name, m.dtype, tuple(m.shape)) for m in sender.current().metas]

        def __iter__(self):
            device = sender.device
            for name, t in sender.current():
                yield name, t.to(device)  # `t` itself when it is there already
                sender.sent += 1

    return StreamSource()


class NCCLSender:
    """vLLM's packed NCCL broadcast. The rendezvous port is picked here: the server is told where it is."""

    backend = "nccl"

    def __init__(
        self, client, *, host: str = LOOPBACK, bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 300.0
    ):
        self.client = client
        self.control = SyncControl(client, timeout_s)
        self.host = host
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.init_timeout_s = timeout_s  # the bound of each stage of the init (watchdog.py)
        self.device: torch.device | None = None  # the NCCL communicator's GPU: tensors are broadcast from there
        self._stream: WeightStream | None = None
        self.engine = None
        self.sent = 0  # tensors of the sync in progress handed to the broadcast (the watchdog names the stage)

    def current(self) -> WeightStream:
        if self._stream is None:
            raise RuntimeError("the NCCL weight source was read outside a sync")
        return self._stream

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
        self._init_with(NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine)

    def _init_with(self, info_cls, engine_cls) -> None:
        """vLLM's trainer engine `engine_cls`, its communicator opened by `BoundedInit` from an `info_cls`."""
        if not torch.cuda.is_available():
            raise RuntimeError("NCCL weight sync needs a CUDA device in the trainer process; use gloo on CPU")
        info = info_cls(
            master_address=self.host,
            master_port=free_port(self.host),
            world_size=1 + self.client.get_world_size(),
            rank=0,  # the one trainer process that sends; vLLM's workers take ranks 1..n
            **self._wire_params(),
        )
        engine = self._engine(engine_cls, info)
        group = engine.model_update_group = BoundedInit(self.control, self.init_timeout_s).open(info)
        self.engine, self.device = engine, group.device

    def _wire_params(self) -> dict:
        return {"packed": True, "packed_buffer_size_bytes": self.bucket_bytes}

    def _engine(self, engine_cls, info):
        return engine_cls(
            client=self.control,
            source=_stream_source(self),
            packed=info.packed,
            packed_buffer_size_bytes=info.packed_buffer_size_bytes,
            packed_num_buffers=info.packed_num_buffers,
        )

    def send(self, named_tensors: NamedTensors, version: int) -> SyncStats:
        if self.engine is None:
            raise RuntimeError("call init() before send()")
        t0 = time.perf_counter()
        stream = as_stream(named_tensors)
        # The optimizer step wrote the parameters on the current stream; vLLM's packer reads them on its own
        # streams, which do not wait for it.
        torch.cuda.current_stream().synchronize()
        nbytes, chunks = self._watched(stream, version)
        self.client.reset_prefix_cache(timeout=self.timeout_s)
        return SyncStats(time.perf_counter() - t0, nbytes, len(stream.metas), chunks, version)

    def _transfer(self, stream: WeightStream, version: int) -> tuple[int, int]:
        """The sync's NCCL part (on the watchdog's thread): (bytes sent, chunks)."""
        self._stream, self.control.next_version = stream, version
        try:
            self.engine.send_weights()  # start -> update_weights ‖ packed broadcast -> finish
        finally:
            self._stream = None
        return stream.nbytes, 0

    def _watched(self, stream: WeightStream, version: int) -> tuple[int, int]:
        self.sent = 0
        self.control.begin()
        device, total = self.device, len(stream.metas)

        def transfer():
            if device is not None and device.type == "cuda":  # CUDA's current device is per thread: 0 on a new one
                torch.accelerator.set_device_index(device.index)
            return self._transfer(stream, version)

        def stage() -> str:
            route = self.control.route
            return f"during {route or 'its start'} ({self.sent} of {total} tensors handed to the broadcast)"

        watchdog = Watchdog(
            timeout_s=self.timeout_s,
            abort=self._abort,
            stage=stage,
            failure=lambda: self.control.failure,
            healthy=lambda: self.client.health(timeout=2.0),
        )
        try:
            return watchdog.run(transfer, f"NCCL weight sync to version {version}")
        except SyncAborted:
            self.engine = None  # an aborted communicator carries nothing more: a new sender inits a new one
            raise

    def _abort(self) -> None:
        """ncclCommAbort (vLLM's `destroy`): the blocked broadcast returns with an error."""
        group = getattr(self.engine, "model_update_group", None)
        if group is not None:
            group.destroy()

    def close(self, polite: bool = True) -> None:
        engine, self.engine = self.engine, None
        if engine is None:
            return
        with contextlib.suppress(Exception):  # a communicator whose peer died may fail to tear down
            engine.shutdown()
        if polite:
            with contextlib.suppress(Exception):  # a goodbye with a short deadline: the server may be gone
                self.client.post("/shutdown_weight_transfer_engine", timeout=5.0)
