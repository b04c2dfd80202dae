"""Run by tests/e2e/test_nccl_sync.py with the vLLM venv's python: our NCCLSender against vLLM's real NCCL engines.

Real: vLLM's trainer engine (`NCCLTrainerInitInfo`, `NCCLTrainerWeightTransferEngine`, its packed producer), vLLM's
RL HTTP routes (its FastAPI routers), vLLM's worker (`Worker`'s weight-transfer methods) and worker engine
(`NCCLWeightTransferEngine`: init/update parsing, packed consumer), vLLM's `StatelessProcessGroup` rendezvous, and
our client, sender and stream. Everything our code hands to vLLM is checked by vLLM's own dataclasses and methods.

Replaced, because there is no GPU here (say so in every report):
- `torch.cuda` / `torch.accelerator`: availability, current device, streams, synchronize (they record calls);
- `PyNcclCommunicator` (the one class that creates the NCCL group; on a host without libnccl vLLM's own turns
  itself into a silent no-op): `StoreCommunicator` moves the broadcast bytes through the real
  `StatelessProcessGroup` store instead, and waits at creation until every rank created its own, as
  `ncclCommInitRank` does; a worker's creation can be made to fail or hang (the init faults);
- the engine client behind the routes (`AsyncLLM` -> engine core -> `collective_rpc`): `Workers` calls each
  worker's real methods in threads, as the worker processes would run them concurrently;
- the worker engine's `start_weight_update` / `finish_weight_update`: vLLM's layerwise reload needs a model built
  by vLLM's loader; the received tensors are recorded instead (loading is covered by tests/e2e/test_vllm_gloo.py).

Prints one JSON report on stdout's last line.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import socket
import sys
import threading
import time
import weakref

import numpy as np
import torch

EVENTS: list[str] = []  # device calls and stream reads, in order
RELEASE = threading.Event()  # set at the end: whatever a fault scenario left waiting ends (threads joined at exit)
INIT_BOUND_S = 2.0  # each init stage's bound in the fault scenarios
CONTROL_TIMEOUT_S = 30.0  # the control requests' own timeout: what would end a stage the bounds did not


class FakeStream:
    def __init__(self, device=None, name: str = "side"):
        self.name = name

    def synchronize(self) -> None:
        EVENTS.append(f"sync:{self.name}")


def fake_device() -> None:
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    torch.cuda.Stream = FakeStream
    torch.cuda.current_stream = lambda device=None: FakeStream(name="current")
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: EVENTS.append("sync:device")
    torch.accelerator.current_device_index = lambda: 0
    torch.accelerator.synchronize = lambda device=None: EVENTS.append("sync:accelerator")


class StoreCommunicator:
    """Stands in for vLLM's `PyNcclCommunicator(group, device)`: same constructor and `broadcast`/`destroy`, the
    bytes carried by the real `StatelessProcessGroup` (its TCP store). Asserts what the NCCL one asserts."""

    instances: list[StoreCommunicator] = []
    trainer_disabled = False  # as vLLM's own is where libnccl cannot be loaded: no `device`, broadcasts do nothing
    worker_fault: str | None = None  # "fail" | "hang": what each worker's creation does after it reached the store

    def __init__(self, group, device, library_path=None):
        self.group, self.rank, self.world_size = group, group.rank, group.world_size
        self.disabled = self.rank == 0 and StoreCommunicator.trainer_disabled
        self.available = not self.disabled
        if not self.disabled:
            self.device = torch.device("cpu")  # where the bytes live without a GPU
            self._join()
        self.broadcasts: list[int] = []
        self.destroyed = False
        StoreCommunicator.instances.append(self)

    def _join(self) -> None:
        """ncclCommInitRank: returns once every rank of the group called it (a rank that never does: never)."""
        if self.rank > 0 and StoreCommunicator.worker_fault == "fail":
            raise RuntimeError("NCCL error: unhandled cuda error (ncclCommInitRank on a worker, injected)")
        if self.rank > 0 and StoreCommunicator.worker_fault == "hang":
            RELEASE.wait()
            raise RuntimeError("released at the end of the script")
        self.group.store.set(f"joined/{self.rank}", b"1")
        while True:  # in slices, so that a rank left waiting ends with the script (RELEASE)
            try:
                self.group.store.wait([f"joined/{r}" for r in range(self.world_size)], datetime.timedelta(seconds=0.5))
                return
            except torch.distributed.DistStoreError:
                if RELEASE.is_set():
                    raise RuntimeError("released at the end of the script") from None

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        if self.disabled:
            return
        assert tensor.device == self.device, f"tensor on {tensor.device}, communicator on {self.device}"
        assert tensor.is_contiguous()
        if self.rank == src:
            self.group.broadcast_obj(tensor.clone(), src)
        else:
            tensor.copy_(self.group.broadcast_obj(None, src))
        self.broadcasts.append(tensor.numel() * tensor.element_size())

    def destroy(self) -> None:
        self.destroyed = True


class RecordingModel:
    """What the worker engine loads into: every tensor it is given, copied (the packed buffer is reused)."""

    def __init__(self):
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights):
        self.loaded += [(n, t.clone()) for n, t in weights]
        return {n for n, _ in weights}


def make_workers(tp: int):
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
    from vllm.v1.worker.gpu_worker import Worker

    class RecordingEngine(NCCLWeightTransferEngine):
        def start_weight_update(self) -> None:
            self.model.loaded.clear()

        def finish_weight_update(self) -> None:
            pass

    workers = []
    for rank in range(tp):
        config = VllmConfig(
            parallel_config=ParallelConfig(tensor_parallel_size=tp, rank=rank),
            weight_transfer_config=WeightTransferConfig(backend="nccl"),
        )
        worker = Worker.__new__(Worker)  # the real class's weight-transfer methods, without loading a model
        worker.vllm_config, worker.rank = config, rank
        worker._weight_update_active, worker._weight_update_is_draft = False, False
        worker.model_runner = type("Runner", (), {"reset_lora_state": lambda self: None})()
        engine = RecordingEngine(config.weight_transfer_config, config, torch.device("cpu"), RecordingModel())
        worker.weight_transfer_engine = engine
        workers.append(worker)
    return workers


class Workers:
    """The engine client vLLM's routes call (`app.state.engine_client`): each call runs on every worker."""

    def __init__(self, workers, update_delay_s: float):
        self.workers, self.update_delay_s = workers, update_delay_s
        self.vllm_config = workers[0].vllm_config
        self.calls: list[str] = []
        self.version: str | None = None
        self.paused = False

    async def _all(self, method: str, *args):
        self.calls.append(method)
        await asyncio.gather(*(asyncio.to_thread(getattr(w, method), *args) for w in self.workers))

    async def init_weight_transfer_engine(self, request):
        if self.hold_init:  # the workers never reach the trainer's store
            await asyncio.to_thread(RELEASE.wait)
            raise RuntimeError("released at the end of the script")
        await self._all("init_weight_transfer_engine", request.init_info)
        if self.hold_answer:  # the workers joined the communicator; the server's answer never comes
            await asyncio.to_thread(RELEASE.wait)

    async def shutdown_weight_transfer_engine(self):
        await self._all("shutdown_weight_transfer_engine")

    async def start_weight_update(self):
        await self._all("start_weight_update")

    async def update_weights(self, request):
        await self._all("update_weights", request.update_info)
        await asyncio.sleep(self.update_delay_s)  # a big model: workers answer once everything is loaded

    async def finish_weight_update(self, weight_version=None):
        await self._all("finish_weight_update")
        if weight_version is not None:
            self.version = weight_version

    async def update_weight_version(self, new_version):
        self.version = new_version

    async def get_weight_version(self):
        return self.version

    async def pause_generation(self, mode="abort", clear_cache=True):
        self.calls.append(f"pause:{mode}")
        self.paused = True

    async def resume_generation(self):
        self.calls.append("resume")
        self.paused = False

    async def is_paused(self):
        return self.paused

    async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append("reset_prefix_cache" + (":running" if reset_running_requests else ""))
        return not self.blocks_held  # vLLM's scheduler: False while blocks are held

    blocks_held = False
    hold_init = hold_answer = False


def serve(engine_client) -> int:
    """vLLM's own RL and cache routers in a FastAPI app, on a free loopback port."""
    import uvicorn
    from fastapi import FastAPI
    from vllm.entrypoints.rl.online.api_router import router as rl_router
    from vllm.entrypoints.serve.dev.cache.api_router import router as cache_router

    app = FastAPI()
    app.include_router(rl_router)
    app.include_router(cache_router)
    app.state.engine_client = engine_client
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return port


def merged_stream(seed: int, rows: int = 48):
    """A stream like a merged LoRA sync: each tensor (W + B @ A) computed when it is pulled, in storage whose
    release is observable (numpy-backed), so the report can say how many bytes of it were alive at once."""
    from verifiers_rl.sync.buckets import TensorMeta
    from verifiers_rl.sync.stream import WeightStream

    gen = torch.Generator().manual_seed(seed)
    base = [(f"model.layers.{i // 4}.mlp.w{i % 4}.weight", torch.randn(rows, 64, generator=gen)) for i in range(24)]
    lora = [(torch.randn(rows, 4, generator=gen), torch.randn(4, 64, generator=gen)) for _ in base]
    live = {"bytes": 0, "max": 0}

    def release(nbytes: int) -> None:
        live["bytes"] -= nbytes

    def produce():
        for (name, w), (b, a) in zip(base, lora):
            EVENTS.append(f"produce:{name}")
            out = np.empty(tuple(w.shape), dtype=np.float32)
            t = torch.from_numpy(out)
            torch.addmm(w, b, a, out=t)
            live["bytes"] += t.nbytes
            live["max"] = max(live["max"], live["bytes"])
            weakref.finalize(out, release, t.nbytes)
            del out
            yield name, t

    metas = [TensorMeta(n, w.dtype, tuple(w.shape)) for n, w in base]
    expected = {n: w + b @ a for (n, w), (b, a) in zip(base, lora)}
    return WeightStream(metas, produce), expected, live


def sync_report(client, workers, engine_client, bucket_bytes: int) -> dict:
    stream, expected, live = merged_stream(seed=7)
    EVENTS.clear()
    stats = client.update_weights(stream, version=7)
    first_produce = next(i for i, e in enumerate(EVENTS) if e.startswith("produce:"))
    received = [[n for n, _ in w.weight_transfer_engine.model.loaded] for w in workers]
    diffs = [
        max((t - expected[n]).abs().max().item() for n, t in w.weight_transfer_engine.model.loaded) for w in workers
    ]
    return {
        "sent_names": [m.name for m in stream.metas],
        "received_names": received,
        "max_abs_diff": max(diffs),
        "stats": {"tensors": stats.tensors, "bytes": stats.bytes, "version": stats.version},
        "weight_version": client.weight_version(),
        "bucket_bytes": bucket_bytes,
        "largest_tensor_bytes": max(m.nbytes for m in stream.metas),
        "total_bytes": stream.nbytes,
        "max_live_bytes": live["max"],
        "current_stream_synced_before_first_read": "sync:current" in EVENTS[:first_produce],
        "calls": list(engine_client.calls),
    }


def cpu_refusal() -> str:
    """Before the device is faked: what a trainer without CUDA is told (vLLM itself imports fine here)."""
    from verifiers_rl.sync.nccl import NCCLSender

    try:
        NCCLSender(client=None).init()
    except RuntimeError as e:
        return str(e)
    return "no error"


def sync_scenarios(report: dict) -> None:
    from verifiers_rl.serving.client import InferenceClient

    bucket_bytes = 40 * 1024
    workers = make_workers(tp=2)
    engine_client = Workers(workers, update_delay_s=report["update_delay_s"])
    port = serve(engine_client)
    # Control requests time out after 0.5 s, /update_weights takes 1.5 s: only the sync timeout may apply to it.
    client = InferenceClient(port=port, request_timeout=report["request_timeout_s"], sync_timeout=60.0)
    client.init_weight_transfer("nccl", bucket_bytes=bucket_bytes)
    engine = workers[0].weight_transfer_engine
    report["init_info"] = {k: getattr(engine, k) for k in ("packed", "packed_buffer_size_bytes")}
    report["group_ranks"] = sorted(c.rank for c in StoreCommunicator.instances)
    report["group_world_sizes"] = [c.world_size for c in StoreCommunicator.instances]
    report["sender_device"] = str(client.sender.device)
    engine_client.calls.clear()
    report.update(sync_report(client, workers, engine_client, bucket_bytes))
    # a server that still cannot drop its cached blocks answers 200 {"success": false} (vLLM's route)
    engine_client.blocks_held = True
    try:
        client.update_weights(merged_stream(seed=8)[0], version=8)
        report["refused_reset"] = "no error"
    except Exception as e:  # noqa: BLE001 - the report carries it to the test
        report["refused_reset"] = f"{type(e).__name__}: {e}"
    engine_client.calls.clear()
    client.close_weight_transfer()
    report["close_calls"] = list(engine_client.calls)
    report["communicators_destroyed"] = [c.destroyed for c in StoreCommunicator.instances]
    # A trainer whose vLLM cannot load libnccl gets a communicator that silently does nothing.
    StoreCommunicator.trainer_disabled = True
    try:
        client.init_weight_transfer("nccl", bucket_bytes=bucket_bytes)
        report["disabled_nccl"] = "no error"
    except RuntimeError as e:
        report["disabled_nccl"] = str(e)


def init_faults(report: dict) -> None:
    """The init's stages, each made to fail or never end; a sender with INIT_BOUND_S per stage."""
    from verifiers_rl.serving.client import InferenceClient
    from verifiers_rl.sync.nccl import NCCLSender

    StoreCommunicator.trainer_disabled = False
    faults = {}
    for fault in ("worker_fails", "worker_hangs", "store_unreached", "answer_never_comes"):
        engine_client = Workers(make_workers(tp=2), update_delay_s=0.0)
        engine_client.hold_init, engine_client.hold_answer = fault == "store_unreached", fault == "answer_never_comes"
        StoreCommunicator.worker_fault = {"worker_fails": "fail", "worker_hangs": "hang"}.get(fault)
        client = InferenceClient(
            port=serve(engine_client), request_timeout=CONTROL_TIMEOUT_S, sync_timeout=CONTROL_TIMEOUT_S
        )
        sender = NCCLSender(client, bucket_bytes=40 * 1024, timeout_s=CONTROL_TIMEOUT_S)
        sender.init_timeout_s = INIT_BOUND_S
        t0 = time.monotonic()
        try:
            sender.init()
            faults[fault] = {"error": "no error"}
        except Exception as e:  # noqa: BLE001 - the report carries it to the test
            faults[fault] = {"error": f"{type(e).__name__}: {e}"}
        faults[fault]["seconds"] = time.monotonic() - t0
    StoreCommunicator.worker_fault = None
    report["init_faults"], report["init_bound_s"], report["control_timeout_s"] = faults, INIT_BOUND_S, CONTROL_TIMEOUT_S


def main() -> None:
    report: dict = {"update_delay_s": 1.5, "request_timeout_s": 0.5, "without_cuda": cpu_refusal()}
    fake_device()
    import vllm.distributed.device_communicators.pynccl as pynccl

    pynccl.PyNcclCommunicator = StoreCommunicator
    try:
        sync_scenarios(report)
        init_faults(report)
    except Exception as e:  # noqa: BLE001 - the report carries it to the test
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        RELEASE.set()
        # the init's stage threads a fault left waiting end now; one that ended during the interpreter's shutdown
        # would free its TCP store there, and torch aborts the process ("terminate called without an active
        # exception"). A real thread stuck in ncclCommInitRank never ends, so never frees anything.
        for t in threading.enumerate():
            if t.name.startswith("nccl-init-"):
                t.join(10)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    sys.exit(main())
