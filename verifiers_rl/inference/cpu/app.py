"""HTTP server for the CPU engine: OpenAI routes + vLLM's RL weight routes, same payloads as vLLM.

Control routes (pause, weights, ...) answer only loopback clients unless `allow_remote_control`, and require
`Authorization: Bearer <control token>` when the launcher set one (it always does). Blocking work (gloo
receives, waiting for the batching loop to pause) runs in worker threads so generation keeps flowing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse

from verifiers_rl.config.net import LOOPBACK, SERVER_KEEP_ALIVE_S
from verifiers_rl.inference.cpu import protocol
from verifiers_rl.inference.cpu.control_routes import generation_router, weight_router
from verifiers_rl.inference.cpu.engine_api import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_SEQS, ServingEngine
from verifiers_rl.inference.cpu.engines import load_engine
from verifiers_rl.inference.cpu.fast_chat import ChatFastPath
from verifiers_rl.inference.cpu.openai_routes import openai_router
from verifiers_rl.inference.cpu.slot_engine import SlotEngine
from verifiers_rl.inference.cpu.weight_receiver import WeightReceiver
from verifiers_rl.serving.auth import ControlGuard

logger = logging.getLogger(__name__)


class ApiKeyGuard:
    """vLLM's --api-key: OpenAI routes (/v1/...) need `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}"

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path", "").startswith("/v1/"):
            auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            if not secrets.compare_digest(auth, self.expected):
                response = JSONResponse(protocol.error_body("missing or wrong API key", 401, "Unauthorized"), 401)
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(
    engine: ServingEngine,
    served_model_name: str,
    *,
    control_token: str | None = None,
    api_key: str | None = None,
    allow_remote_control: bool = False,
    fast_chat: bool = True,
) -> FastAPI:
    """The CPU server: OpenAI routes, then vLLM's RL routes (generation control, weight sync), behind the control
    guard and, with `api_key`, vLLM's API-key check on /v1. `fast_chat=False` leaves chat requests to FastAPI's
    route alone (tests compare the two)."""
    receiver = WeightReceiver(engine)

    @asynccontextmanager
    async def lifespan(app):
        # Blocking control work (weight receives and copies) runs in this pool; its threads keep one intra-op
        # thread so that the generation loop's OpenMP team is the only one in the process (see `serve`).
        pool = ThreadPoolExecutor(thread_name_prefix="vf-engine-control", initializer=_one_intra_op_thread)
        asyncio.get_running_loop().set_default_executor(pool)
        yield
        await asyncio.to_thread(engine.close)

    app = FastAPI(title="verifiers-rl CPU engine", lifespan=lifespan)
    app.state.engine = engine
    app.state.receiver = receiver
    # first added = innermost: the fast path runs after the guards and FastAPI's body limit
    if fast_chat:
        app.add_middleware(ChatFastPath, engine=engine, served_model_name=served_model_name)
    app.add_middleware(ControlGuard, token=control_token, allow_remote=allow_remote_control)
    if api_key:
        app.add_middleware(ApiKeyGuard, api_key=api_key)
    app.include_router(openai_router(engine, served_model_name))
    app.include_router(generation_router(engine))
    app.include_router(weight_router(engine, receiver))

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        return JSONResponse(protocol.error_body(str(exc.detail), exc.status_code), exc.status_code)

    return app


def serve(
    model: str,
    host: str = LOOPBACK,
    port: int = 8000,
    *,
    served_model_name: str | None = None,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    cpu_engine: str = "auto",
    control_token: str | None = None,
    api_key: str | None = None,
    allow_remote_control: bool = False,
    log_level: str = "info",
    access_log: bool = True,
    fast_chat: bool = True,
    http: str = "auto",
    lean_load: bool = True,
) -> None:
    """Load the engine and serve it with uvicorn. `fast_chat` and `http` (uvicorn's parser: auto picks httptools,
    installed with us) exist for benchmarks/bench_server_http.py, which serves the same engine both ways;
    `lean_load=False` (the model through transformers' from_pretrained) for benchmarks/bench_server_start.py."""
    import torch
    import uvicorn

    from verifiers_rl.models import weight_bytes as model_weight_bytes

    # torch's default: OMP_NUM_THREADS when set (the user's, or the trainer's split of the cores), else every core
    default_threads = torch.get_num_threads()
    # Only the generation loop's thread may build an OpenMP team: a team once used on another thread (the model load
    # here, a weight copy) slows the loop's decode on the same cores even while idle
    # (benchmarks/results/design_measurements.md#one-openmp-team).
    torch.set_num_threads(1)
    engine = load_engine(model, impl=cpu_engine, lean=lean_load, max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    if isinstance(engine, SlotEngine):
        pinned = os.environ.get("OMP_NUM_THREADS")
        weight_bytes = model_weight_bytes(engine.model)
        threads = default_threads if pinned else engine_threads(weight_bytes)
        engine.threads = threads
        logger.info(
            "CPU engine: %d intra-op thread(s) for %.0f MB of weights%s",
            threads,
            weight_bytes / 2**20,
            " (OMP_NUM_THREADS)" if pinned else "",
        )
        # The engine thread takes the GIL back between its torch ops faster than the event loop thread wakes up,
        # so requests wait out the 5 ms switch interval while a step runs and a burst trickles in; 1 ms gives
        # more tokens/s (benchmarks/results/design_measurements.md#switch-interval).
        sys.setswitchinterval(0.001)
    else:
        torch.set_num_threads(default_threads)  # transformers' continuous batching runs on torch's default
    app = create_app(
        engine,
        served_model_name or model,
        control_token=control_token,
        api_key=api_key,
        allow_remote_control=allow_remote_control,
        fast_chat=fast_chat,
    )
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=SERVER_KEEP_ALIVE_S,
        http=http,
    )


def _one_intra_op_thread() -> None:
    import torch

    torch.set_num_threads(1)
    # A thread takes torch's process-wide count (the loop's, once it is set) at its first parallel op unless it
    # has asked for its count already: this asks now.
    torch.get_num_threads()


# Decoders whose weights are at least this many bytes decode with every core: each step's matrix products are then
# long enough that a second thread's share outweighs its synchronisation and the event loop's lost core (the
# crossover lies between 77 MB and 506 MB: benchmarks/results/design_measurements.md#engine-threads). The demos'
# tiny models stay at one thread.
ALL_CORES_WEIGHT_BYTES = 256 << 20


def engine_threads(weight_bytes: int, cores: int | None = None) -> int:
    """Intra-op threads for the slot engine: every core but one (the event loop's, and on one machine the
    clients'), or every core for a decoder of at least ALL_CORES_WEIGHT_BYTES (see there): a small model is faster
    on one thread than on two (bench_engine)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if weight_bytes >= ALL_CORES_WEIGHT_BYTES:
        return max(1, cores)
    return max(1, cores - 1)
