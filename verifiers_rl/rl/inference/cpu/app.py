"""HTTP server for the CPU engine: OpenAI routes + vLLM's RL weight routes, same payloads as vLLM.

Control routes (pause, weights, ...) answer only loopback clients unless `allow_remote_control`, and require
`Authorization: Bearer <control token>` when the launcher set one (it always does). Blocking work (gloo
receives, waiting for the batching loop to pause) runs in worker threads so generation keeps flowing.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse

from verifiers_rl.rl.inference.control_auth import ControlGuard
from verifiers_rl.rl.inference.cpu import protocol
from verifiers_rl.rl.inference.cpu.control_routes import generation_router, weight_router
from verifiers_rl.rl.inference.cpu.engine_api import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_SEQS, Engine
from verifiers_rl.rl.inference.cpu.engines import load_engine
from verifiers_rl.rl.inference.cpu.openai_routes import openai_router
from verifiers_rl.rl.inference.cpu.slot_engine import SlotEngine
from verifiers_rl.rl.inference.cpu.weight_receiver import WeightReceiver
from verifiers_rl.rl.inference.net import SERVER_KEEP_ALIVE_S


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
    engine: Engine,
    served_model_name: str,
    *,
    control_token: str | None = None,
    api_key: str | None = None,
    allow_remote_control: bool = False,
) -> FastAPI:
    """The CPU server: OpenAI routes, then vLLM's RL routes (generation control, weight sync), behind the control
    guard and, with `api_key`, vLLM's API-key check on /v1."""
    receiver = WeightReceiver(engine)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(engine.close)

    app = FastAPI(title="verifiers-rl CPU engine", lifespan=lifespan)
    app.state.engine = engine
    app.state.receiver = receiver
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
    host: str = "127.0.0.1",
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
) -> None:
    import uvicorn

    engine = load_engine(model, impl=cpu_engine, max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    if isinstance(engine, SlotEngine):
        _set_engine_threads()
        # The engine thread takes the GIL back between its torch ops faster than the event loop thread wakes up,
        # so requests wait out the 5 ms switch interval while a step runs: a burst of 32 trickled in over
        # 40-170 ms. 1 ms: 3,665 vs 3,475 tok/s at 32 concurrent, 4,401 vs 4,009 on 8 x 4 (interleaved rounds).
        sys.setswitchinterval(0.001)
    app = create_app(
        engine,
        served_model_name or model,
        control_token=control_token,
        api_key=api_key,
        allow_remote_control=allow_remote_control,
    )
    uvicorn.run(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
        timeout_keep_alive=SERVER_KEEP_ALIVE_S,
    )  # fmt: skip


def _set_engine_threads() -> None:
    """Intra-op threads for the slot engine: every core but one, which the event loop (and, on one machine, the
    clients) need; OMP_NUM_THREADS wins when set (the trainer sets it when it overlaps with generation).
    Measured on 2 cores (bench_engine, tiny Qwen3 h128 x 4, 32 concurrent): 1 thread 3,700-4,000 tok/s,
    2 threads 2,600-3,000; h512 x 8: 365 vs 283."""
    if os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores - 1))
