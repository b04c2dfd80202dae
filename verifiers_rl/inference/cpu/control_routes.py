"""vLLM's RL control routes on the CPU server, same payloads: generation (pause, resume), the weight sync
(`/init_weight_transfer_engine` ... `/finish_weight_update`, adapter updates through `/collective_rpc`), and
the policy version. The control guard (serving/auth.py) sits in front of all of them."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Body, Query

from verifiers_rl.config.choices import Transport
from verifiers_rl.inference.cpu.engine_api import ServingEngine
from verifiers_rl.inference.cpu.openai_routes import bad_request
from verifiers_rl.inference.cpu.weight_receiver import WeightReceiver
from verifiers_rl.serving import identity
from verifiers_rl.sync.transport import adapter


def version_number(name: str, value) -> int:
    """Versions are policy versions (optimizer steps): a non-negative integer, sent as text like vLLM's."""
    try:
        number = int(str(value))
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a non-negative integer (the policy version)") from None
    if number < 0:
        raise ValueError(f"{name}={value!r}: expected a non-negative integer (the policy version)")
    return number


def generation_router(engine: ServingEngine) -> APIRouter:
    router = APIRouter()

    @router.get("/get_world_size")
    async def world_size():
        return {"world_size": 1}

    @router.post("/pause")
    async def pause(mode: str = Query("abort"), clear_cache: bool = Query(True)):  # noqa: ARG001 - vLLM's signature
        if mode not in ("abort", "wait", "keep"):
            return bad_request(ValueError(f"mode={mode!r}; allowed: abort, wait, keep"))
        if mode == "abort":
            await asyncio.to_thread(engine.abort_all)
        elif mode == "wait":
            await engine.wait_idle()
        await asyncio.to_thread(engine.pause)
        return {"status": "paused"}

    @router.post("/resume")
    async def resume():
        await asyncio.to_thread(engine.resume)
        return {"status": "resumed"}

    @router.get("/is_paused")
    async def is_paused():
        return {"is_paused": engine.is_paused}

    # vLLM's query flags are accepted and need nothing here: running requests keep KV of their own, only the
    # shared prompt cache is dropped, so the reset always succeeds.
    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(
        reset_running_requests: bool = Query(False),  # noqa: ARG001
        reset_external: bool = Query(False),  # noqa: ARG001
    ):
        await asyncio.to_thread(engine.reset_prefix_cache)
        return {"success": True}

    @router.post("/update_weight_version")
    async def update_weight_version(new_version: str | int = Body(..., embed=True)):
        try:
            engine.version = version_number("new_version", new_version)
        except ValueError as e:
            return bad_request(e)
        return {"success": True, "new_version": str(new_version)}

    @router.get("/weight_info")
    async def weight_info():
        return {"weight_version": str(engine.version)}

    return router


def weight_router(engine: ServingEngine, receiver: WeightReceiver) -> APIRouter:
    router = APIRouter()

    @router.post("/init_weight_transfer_engine")
    async def init_transfer(init_info: dict[str, Any] = Body(..., embed=True)):
        try:
            shared = await asyncio.to_thread(receiver.init, init_info)
        except ValueError as e:
            return bad_request(e)
        return {"message": "Weight transfer initialized", "shm": shared}

    @router.post("/start_weight_update")
    async def start_update():
        await asyncio.to_thread(receiver.start)
        return {"message": "Weight update started"}

    @router.post("/update_weights")
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

    @router.post("/finish_weight_update")
    async def finish_update(weight_version: str | int | None = Body(None, embed=True)):
        try:
            version = None if weight_version is None else version_number("weight_version", weight_version)
        except ValueError as e:
            return bad_request(e)
        v = await asyncio.to_thread(receiver.finish, version)
        return {"message": "Weight update finished", "weight_version": str(v)}

    @router.post("/shutdown_weight_transfer_engine")
    async def shutdown_transfer():
        receiver.shutdown()
        return {"message": "Weight transfer shut down"}

    @router.post("/collective_rpc")
    async def collective_rpc(body: dict[str, Any] = Body(...)):
        # vLLM's dev route calls a method on every worker; the CPU engine has one "worker" and knows three methods
        method, args = body.get("method"), body.get("args") or []
        try:
            if method == identity.IDENTITY_RPC:  # it receives over gloo only
                result = {"config": identity.describe(engine.model.config), "backend": Transport.GLOO}
            elif method == adapter.INFO_RPC:
                result = {"engine": "cpu", "max_lora_rank": None, "max_loras": 1, "adapters": []}
            elif method == adapter.UPDATE_RPC and len(args) == 1:
                result = await asyncio.to_thread(receiver.lora_update, args[0])
            else:
                supported = f"{identity.IDENTITY_RPC}(), {adapter.INFO_RPC}() and {adapter.UPDATE_RPC}(update_json)"
                raise ValueError(f"collective_rpc: the CPU engine supports {supported}, not {method!r}")
        except (ValueError, KeyError) as e:
            return bad_request(e)
        return {"results": [result]}

    return router
