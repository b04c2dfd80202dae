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
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Body, FastAPI, HTTPException, Query
from fastapi.responses import JSONResponse

from verifiers_rl.rl.inference import protocol
from verifiers_rl.rl.inference.control_auth import ControlGuard
from verifiers_rl.rl.inference.engine import CPUEngine, EngineError
from verifiers_rl.rl.inference.engines import load_engine
from verifiers_rl.rl.inference.layout import ADAPTER_NAME
from verifiers_rl.rl.inference.slot_engine import SlotEngine
from verifiers_rl.rl.inference.transfer import adapter
from verifiers_rl.rl.inference.weight_receiver import WeightReceiver

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
    engine: CPUEngine | SlotEngine,
    served_model_name: str,
    *,
    control_token: str | None = None,
    api_key: str | None = None,
    allow_remote_control: bool = False,
) -> FastAPI:
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

    def bad_request(e: Exception) -> JSONResponse:
        return JSONResponse(protocol.error_body(str(e)), 400)

    def failed(e: Exception) -> JSONResponse:
        # One request failed; the engine isolates it and keeps serving (a dead loop shows up in /health).
        if not isinstance(e, EngineError):
            logger.exception("generation failed", exc_info=e)
        return JSONResponse(protocol.error_body(f"{type(e).__name__}: {e}", 500, "InternalServerError"), 500)

    def unknown_model(name: str | None) -> JSONResponse | None:
        # the adapter name too: with adapter sync the trainer's rollouts name the policy adapter, as on vLLM
        if not name or name in (served_model_name, ADAPTER_NAME):
            return None
        return JSONResponse(protocol.error_body(f"The model `{name}` does not exist.", 404, "NotFoundError"), 404)

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return JSONResponse({"status": "error", "message": "the generation loop is not running"}, 503)
        return {"status": "ok", "policy_version": engine.version, "is_paused": engine.is_paused}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": served_model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "verifiers-rl",
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat(req: protocol.ChatCompletionRequest):
        if (resp := unknown_model(req.model)) is not None:
            return resp
        try:
            params = req.to_sampling_params()
            prompt_ids = protocol.render_chat(engine.tokenizer, req)
            completions = await engine.generate(prompt_ids, params)
        except (ValueError, TypeError) as e:
            return bad_request(e)
        except Exception as e:  # noqa: BLE001 - this request fails, the server does not
            return failed(e)
        # JSONResponse directly: FastAPI's jsonable_encoder walk over every logprob entry costs more than the dump
        return JSONResponse(
            protocol.chat_response(
                engine.tokenizer, req.model or served_model_name, req, params, prompt_ids, completions
            )
        )

    @app.post("/v1/completions")
    async def completions(req: protocol.CompletionRequest):
        if (resp := unknown_model(req.model)) is not None:
            return resp
        try:
            params = req.to_sampling_params()
            prompts = protocol.completion_prompts(engine.tokenizer, req.prompt)
            results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        except (ValueError, TypeError) as e:
            return bad_request(e)
        except Exception as e:  # noqa: BLE001 - this request fails, the server does not
            return failed(e)
        choices = []
        for p, comps in zip(prompts, results):
            choices += protocol.completion_choices(engine.tokenizer, req, params, p, comps, len(choices))
        all_comps = [c for comps in results for c in comps]
        return JSONResponse(
            {
                "id": f"cmpl-{secrets.token_hex(12)}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": req.model or served_model_name,
                "choices": choices,
                "usage": protocol._usage([t for p in prompts for t in p], all_comps),
            }
        )

    # ---------------------------------------------------------------- vLLM RL routes (same payloads)

    @app.get("/get_world_size")
    async def world_size():
        return {"world_size": 1}

    @app.post("/pause")
    async def pause(mode: str = Query("abort"), clear_cache: bool = Query(True)):  # noqa: ARG001 - vLLM's signature
        if mode not in ("abort", "wait", "keep"):
            return bad_request(ValueError(f"mode={mode!r}; allowed: abort, wait, keep"))
        if mode == "abort":
            await asyncio.to_thread(engine.abort_all)
        elif mode == "wait":
            await engine.wait_idle()
        await asyncio.to_thread(engine.pause)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        await asyncio.to_thread(engine.resume)
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": engine.is_paused}

    @app.post("/init_weight_transfer_engine")
    async def init_transfer(init_info: dict[str, Any] = Body(..., embed=True)):
        try:
            await asyncio.to_thread(receiver.init, init_info)
        except ValueError as e:
            return bad_request(e)
        return {"message": "Weight transfer initialized"}

    @app.post("/start_weight_update")
    async def start_update():
        await asyncio.to_thread(receiver.start)
        return {"message": "Weight update started"}

    def version_number(name: str, value) -> int:
        # versions are policy versions (optimizer steps): a non-negative integer, sent as text like vLLM's
        try:
            number = int(str(value))
        except ValueError:
            raise ValueError(f"{name}={value!r}: expected a non-negative integer (the policy version)") from None
        if number < 0:
            raise ValueError(f"{name}={value!r}: expected a non-negative integer (the policy version)")
        return number

    @app.post("/update_weights")
    async def update_weights(
        update_info: dict[str, Any] | list[dict[str, Any]] = Body(..., embed=True),
        weight_version: str | int | None = Body(None, embed=True),
    ):
        """vLLM's route; ours: with `weight_version` it is the whole sync in one round trip (pause, receive,
        finish with that version, reset the prefix cache, resume) instead of six control requests."""
        infos = update_info if isinstance(update_info, list) else [update_info]
        try:
            version = None if weight_version is None else version_number("weight_version", weight_version)
            if version is not None:
                await asyncio.to_thread(receiver.start)
            loaded = 0
            for info in infos:
                loaded += await asyncio.to_thread(receiver.update, info)
        except (ValueError, KeyError) as e:
            if weight_version is not None:
                await asyncio.to_thread(receiver.abandon)
            return bad_request(e)
        if version is not None:
            await asyncio.to_thread(receiver.finish, version)
        return {"message": "Weights updated", "tensors": loaded}

    @app.post("/finish_weight_update")
    async def finish_update(weight_version: str | int | None = Body(None, embed=True)):
        try:
            version = None if weight_version is None else version_number("weight_version", weight_version)
        except ValueError as e:
            return bad_request(e)
        v = await asyncio.to_thread(receiver.finish, version)
        return {"message": "Weight update finished", "weight_version": str(v)}

    @app.post("/shutdown_weight_transfer_engine")
    async def shutdown_transfer():
        receiver.shutdown()
        return {"message": "Weight transfer shut down"}

    @app.post("/collective_rpc")
    async def collective_rpc(body: dict[str, Any] = Body(...)):
        # vLLM's dev route calls a method on every worker; the CPU engine has one "worker" and knows two methods
        method, args = body.get("method"), body.get("args") or []
        try:
            if method == adapter.INFO_RPC:
                result = {"engine": "cpu", "max_lora_rank": None, "max_loras": 1, "adapters": []}
            elif method == adapter.UPDATE_RPC and len(args) == 1:
                result = await asyncio.to_thread(receiver.lora_update, args[0])
            else:
                supported = f"{adapter.INFO_RPC}() and {adapter.UPDATE_RPC}(update_json)"
                raise ValueError(f"collective_rpc: the CPU engine supports {supported}, not {method!r}")
        except (ValueError, KeyError) as e:
            return bad_request(e)
        return {"results": [result]}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        await asyncio.to_thread(engine.reset_prefix_cache)
        return {"status": "ok"}

    @app.post("/update_weight_version")
    async def update_weight_version(new_version: str | int = Body(..., embed=True)):
        try:
            engine.version = version_number("new_version", new_version)
        except ValueError as e:
            return bad_request(e)
        return {"success": True, "new_version": str(new_version)}

    @app.get("/weight_info")
    async def weight_info():
        return {"weight_version": str(engine.version)}

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
    max_model_len: int = 4096,
    max_num_seqs: int = 64,
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
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


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
