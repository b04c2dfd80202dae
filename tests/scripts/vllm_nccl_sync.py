"""Run by tests/e2e/test_nccl_sync.py with the vLLM venv's python: our NCCLSender against vLLM's real NCCL engines.

Real: vLLM's trainer engine (`NCCLTrainerInitInfo`, `NCCLTrainerWeightTransferEngine`, its packed producer), vLLM's
RL HTTP routes (its FastAPI routers), vLLM's worker (`Worker`'s weight-transfer methods) and worker engine
(`NCCLWeightTransferEngine`: init/update parsing, packed consumer), vLLM's `StatelessProcessGroup` rendezvous, and
our client, sender and stream. Everything our code hands to vLLM is checked by vLLM's own dataclasses and methods.

Replaced, because there is no GPU here (say so in every report):
- `torch.cuda` / `torch.accelerator`: availability, current device (per thread, as CUDA's: the main thread is on
  device 1, a new thread on 0), streams, synchronize (they record calls);
- `PyNcclCommunicator` (the one class that creates the NCCL group; on a host without libnccl vLLM's own turns
  itself into a silent no-op): `StoreCommunicator` moves the broadcast bytes through the real
  `StatelessProcessGroup` store instead, and waits at creation until every rank created its own, as
  `ncclCommInitRank` does; a worker's creation can be made to fail or hang (the init faults); the trainer's
  broadcast can be made to block until the communicator is aborted (`destroy`, vLLM's ncclCommAbort), as an NCCL
  broadcast whose receivers are gone does (the sync faults);
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
SYNC_TIMEOUT_S = 30.0  # a sync's deadline in the sync faults the watchdog must end sooner by what it watches
SHORT_TIMEOUT_S = 2.0  # the deadline of the sync fault only the deadline can end


class FakeStream:
    def __init__(self, device=None, name: str = "side"):
        self.name = name

    def synchronize(self) -> None:
        EVENTS.append(f"sync:{self.name}")


def _current_device() -> int:
    """CUDA's current device is per thread: the trainer's main thread chose device 1, a new thread starts on 0."""
    return 1 if threading.current_thread() is threading.main_thread() else 0


def fake_device() -> None:
    torch.cuda.is_available = lambda: True
    torch.cuda.current_device = _current_device
    torch.cuda.device_count = lambda: 1
    torch.cuda.Stream = FakeStream
    torch.cuda.current_stream = lambda device=None: FakeStream(name="current")
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: EVENTS.append("sync:device")
    torch.accelerator.current_device_index = _current_device
    torch.accelerator.synchronize = lambda device=None: EVENTS.append("sync:accelerator")


class StoreCommunicator:
    """Stands in for vLLM's `PyNcclCommunicator(group, device)`: same constructor and `broadcast`/`destroy`, the
    bytes carried by the real `StatelessProcessGroup` (its TCP store). Asserts what the NCCL one asserts."""

    instances: list[StoreCommunicator] = []
    trainer_disabled = False  # as vLLM's own is where libnccl cannot be loaded: no `device`, broadcasts do nothing
    worker_fault: str | None = None  # "fail" | "hang": what each worker's creation does after it reached the store
    hang_sender_after: int | None = None  # the trainer's broadcast number N (0-based) blocks until destroy()
    trainer_devices: list = []  # the `device` the trainer's rank was created with

    def __init__(self, group, device, library_path=None):
        self.group, self.rank, self.world_size = group, group.rank, group.world_size
        self.aborted = threading.Event()
        if self.rank == 0:
            StoreCommunicator.trainer_devices.append(device)
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
            hang = StoreCommunicator.hang_sender_after
            if hang is not None and len(self.broadcasts) >= hang:  # its receivers are gone: NCCL never returns
                self.aborted.wait(60)
                raise RuntimeError("NCCL error: remote process exited or communicator aborted (injected)")
            self.group.broadcast_obj(tensor.clone(), src)
        else:
            key = f"broadcast_from/{src}/{self.group.broadcast_recv_src_counter[src]}"
            while True:  # in slices, so that a receiver the trainer abandoned ends with the script (RELEASE)
                try:
                    self.group.store.wait([key], datetime.timedelta(seconds=0.5))
                    break
                except torch.distributed.DistStoreError:
                    if RELEASE.is_set() or self.aborted.is_set():
                        raise RuntimeError("released at the end of the script") from None
            tensor.copy_(self.group.broadcast_obj(None, src))
        self.broadcasts.append(tensor.numel() * tensor.element_size())

    def destroy(self) -> None:
        self.destroyed = True
        self.aborted.set()


class RecordingModel:
    """What the worker engine loads into: every tensor it is given, copied (the packed buffer is reused)."""

    fails = False  # load_weights raises, as a worker out of memory does

    def __init__(self):
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights):
        if RecordingModel.fails:
            raise torch.OutOfMemoryError("CUDA out of memory while loading weights (injected)")
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
        if self.dead:  # the engine died: the request never returns, the workers never receive
            await asyncio.to_thread(RELEASE.wait)
            raise RuntimeError("released at the end of the script")
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
    dead = False  # /health answers 503 and /update_weights never returns


def serve(engine_client) -> int:
    """vLLM's own RL and cache routers in a FastAPI app, on a free loopback port."""
    import uvicorn
    from fastapi import FastAPI
    from vllm.entrypoints.rl.online.api_router import router as rl_router
    from vllm.entrypoints.serve.dev.cache.api_router import router as cache_router

    app = FastAPI()

    @app.get("/health")
    async def health():
        from fastapi.responses import Response

        return Response(status_code=503 if engine_client.dead else 200)

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
    from verifiers_rl.sync.transport.nccl import NCCLSender

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
    from verifiers_rl.sync.transport.nccl import NCCLSender

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


def _fresh_client(timeout_s: float):
    """A server with two workers, a client and an NCCL sender joined to it."""
    from verifiers_rl.serving.client import InferenceClient

    workers = make_workers(tp=2)
    engine_client = Workers(workers, update_delay_s=0.0)
    client = InferenceClient(port=serve(engine_client), request_timeout=CONTROL_TIMEOUT_S, sync_timeout=timeout_s)
    client.init_weight_transfer("nccl", bucket_bytes=40 * 1024)
    return client, workers, engine_client


def sync_faults(report: dict) -> None:
    """A sync whose receivers stop mid-way: the trainer's broadcast blocks until the communicator is aborted (as NCCL's
    does), so only the watchdog (sync/transport/watchdog.py) can end it. The sync timeout is SYNC_TIMEOUT_S except
    where the deadline itself is what ends it."""
    from verifiers_rl.trainer.preemption import PreemptionGuard, StepAbandoned

    faults = {}
    scenarios = {
        "worker_raises": SYNC_TIMEOUT_S,  # a worker's load_weights raised: /update_weights fails with 500
        "server_dies": SYNC_TIMEOUT_S,  # /health 503, /update_weights never answers
        "silent_hang": SHORT_TIMEOUT_S,  # the server looks fine, nothing moves: the deadline
        "sigterm": SYNC_TIMEOUT_S,  # a signal during the hung sync, inside an abandonable wait as the trainer's
    }
    for fault, timeout_s in scenarios.items():
        client, _, engine_client = _fresh_client(timeout_s)
        comm = next(c for c in reversed(StoreCommunicator.instances) if c.rank == 0)
        StoreCommunicator.hang_sender_after = 2
        RecordingModel.fails = fault == "worker_raises"
        engine_client.dead = fault == "server_dies"
        if fault in ("silent_hang", "sigterm"):  # healthy, and the request never answers
            engine_client.update_weights = _never_answers
        t0 = time.monotonic()
        try:
            if fault == "sigterm":
                import os
                import signal

                threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
                with PreemptionGuard() as guard, guard.abandonable():
                    client.update_weights(merged_stream(seed=9)[0], version=9)
            else:
                client.update_weights(merged_stream(seed=9)[0], version=9)
            faults[fault] = {"error": "no error"}
        except (Exception, StepAbandoned) as e:  # noqa: BLE001 - the report carries it to the test
            faults[fault] = {"error": f"{type(e).__name__}: {e}"}
        seconds, closed = time.monotonic() - t0, client.sender.engine is None
        faults[fault].update(seconds=seconds, aborted=comm.destroyed, sender_closed=closed)
        StoreCommunicator.hang_sender_after, RecordingModel.fails = None, False
    # the run goes on with a new server (what recovery does after a dead one): a new sender, a sync that lands
    client, workers, _ = _fresh_client(SYNC_TIMEOUT_S)
    stream, expected, _ = merged_stream(seed=10)
    client.update_weights(stream, version=10)
    loaded = workers[1].weight_transfer_engine.model.loaded
    faults["recovered"] = {
        "version": client.weight_version(),
        "max_abs_diff": max((t - expected[n]).abs().max().item() for n, t in loaded),
        "tensors": len(loaded),
    }
    report["sync_faults"], report["sync_timeout_s"], report["short_timeout_s"] = faults, SYNC_TIMEOUT_S, SHORT_TIMEOUT_S
    report["trainer_comm_devices"] = [str(d) for d in StoreCommunicator.trainer_devices]


async def _never_answers(request):
    await asyncio.to_thread(RELEASE.wait)
    raise RuntimeError("released at the end of the script")


def sparse_patch_devices() -> dict:
    """Where the sparse path's patches go: to the communicator's device, wherever the tensor lay."""
    from verifiers_rl.sync.delta import Sparse
    from verifiers_rl.sync.transport.sparse_nccl import _patch

    meta = torch.device("meta")  # stands in for the communicator's GPU: any device but the tensor's own
    whole = _patch("w", torch.randn(4, 8), (4, 8), meta)
    sparse = _patch("w", Sparse(torch.tensor([1, 5]), torch.randn(2)), (4, 8), meta)
    return {kind: [str(p.indices.device), str(p.values.device)] for kind, p in (("whole", whole), ("sparse", sparse))}


def main() -> None:
    report: dict = {"update_delay_s": 1.5, "request_timeout_s": 0.5, "without_cuda": cpu_refusal()}
    fake_device()
    import vllm.distributed.device_communicators.pynccl as pynccl

    pynccl.PyNcclCommunicator = StoreCommunicator
    try:
        sync_scenarios(report)
        init_faults(report)
        sync_faults(report)
        report["sparse_patch_devices"] = sparse_patch_devices()
    except Exception as e:  # noqa: BLE001 - the report carries it to the test
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        RELEASE.set()
        # the init's stage threads a fault left waiting end now; one that ended during the interpreter's shutdown
        # would free its TCP store there, and torch aborts the process ("terminate called without an active
        # exception"). A real thread stuck in ncclCommInitRank never ends, so never frees anything.
        for t in threading.enumerate():
            if t.name.startswith(("nccl-init-", "vf-NCCL")):
                t.join(10)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    sys.exit(main())
