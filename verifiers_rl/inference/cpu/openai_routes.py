"""The OpenAI routes of the CPU server (/health, /v1/models, /v1/chat/completions, /v1/completions), answering
with vLLM's extra fields (`protocol.py`)."""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from verifiers_rl.inference.cpu import protocol
from verifiers_rl.inference.cpu.engine_api import EngineError, ServingEngine
from verifiers_rl.plan.layout import ADAPTER_NAME

logger = logging.getLogger(__name__)


def bad_request(e: Exception) -> JSONResponse:
    return JSONResponse(protocol.error_body(str(e)), 400)


def failed(e: Exception) -> JSONResponse:
    # One request failed; the engine isolates it and keeps serving (a dead loop shows up in /health).
    if not isinstance(e, EngineError):
        logger.exception("generation failed", exc_info=e)
    return JSONResponse(protocol.error_body(f"{type(e).__name__}: {e}", 500, "InternalServerError"), 500)


def _unknown_model(name: str | None, served_model_name: str) -> JSONResponse | None:
    # the adapter name too: with adapter sync the trainer's rollouts name the policy adapter, as on vLLM
    if not name or name in (served_model_name, ADAPTER_NAME):
        return None
    return JSONResponse(protocol.error_body(f"The model `{name}` does not exist.", 404, "NotFoundError"), 404)


async def chat_completion(
    engine: ServingEngine, served_model_name: str, req: protocol.ChatCompletionRequest
) -> JSONResponse:
    """One chat request, validated: the FastAPI route and the fast path (fast_chat.py) both answer with this."""
    if (resp := _unknown_model(req.model, served_model_name)) is not None:
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
    body = protocol.chat_response(
        engine.tokenizer, req.model or served_model_name, req, params, prompt_ids, completions
    )
    return JSONResponse(body)


def openai_router(engine: ServingEngine, served_model_name: str) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health():
        if not engine.healthy:
            return JSONResponse({"status": "error", "message": "the generation loop is not running"}, 503)
        return {"status": "ok", "policy_version": engine.version, "is_paused": engine.is_paused}

    @router.get("/v1/models")
    async def models():
        model = {
            "id": served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "verifiers-rl",
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [model]}

    @router.post("/v1/chat/completions")
    async def chat(req: protocol.ChatCompletionRequest):
        return await chat_completion(engine, served_model_name, req)

    @router.post("/v1/completions")
    async def completions(req: protocol.CompletionRequest):
        if (resp := _unknown_model(req.model, served_model_name)) is not None:
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
        body = {
            "id": protocol.new_id("cmpl"),
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model or served_model_name,
            "choices": choices,
            "usage": protocol.usage([t for p in prompts for t in p], all_comps),
        }
        return JSONResponse(body)

    return router
