"""The lean request path builds the body the OpenAI SDK would send for verifiers' arguments."""

from __future__ import annotations

import json

from verifiers_rl.rollouts.client import chat_request_body, rollout_seed

MSGS = [{"role": "user", "content": "hi"}]


def test_body_renames_max_tokens_merges_extra_body_and_drops_none():
    body, headers = chat_request_body(
        "m",
        MSGS,
        {
            "max_tokens": 8,
            "temperature": 0.7,
            "top_p": None,
            "seed": 3,
            "extra_body": {"return_token_ids": True, "top_k": 5, "temperature": 0.9},
            "extra_headers": {"X-Session": "s1"},
        },
    )
    assert body == {
        "model": "m",
        "messages": MSGS,
        "max_completion_tokens": 8,
        "temperature": 0.9,  # extra_body wins, as in the SDK
        "seed": 3,
        "return_token_ids": True,
        "top_k": 5,
    }
    assert headers == {"X-Session": "s1"}
    json.dumps(body)


def test_body_carries_tools_only_when_given():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat_request_body("m", MSGS, {}, tools)[0]["tools"] == tools
    assert "tools" not in chat_request_body("m", MSGS, {}, [])[0]


def test_rollout_seed_is_stable_and_distinct():
    assert rollout_seed(0, "1:2:3", 0) == rollout_seed(0, "1:2:3", 0)
    assert len({rollout_seed(0, "1:2:3", t) for t in range(4)} | {rollout_seed(1, "1:2:3", 0)}) == 5
    assert 0 <= rollout_seed(5, "k", 9) < 2**47


def test_lean_path_sends_the_sdks_headers_and_path():
    """What reaches the server: the SDK's auth header (servers started with --api-key check it), verifiers' state
    headers, the chat route under the base URL, and the JSON body; the reply comes back as the SDK's type."""
    import asyncio

    from aiohttp import web
    from openai import AsyncOpenAI
    from openai.types.chat import ChatCompletion

    from verifiers_rl.rollouts.client import RolloutClient

    seen = {}

    async def chat(request):
        seen.update(path=request.path, auth=request.headers.get("Authorization"), session=request.headers.get("X-S"))
        seen["body"] = await request.json()
        return web.json_response(
            {
                "id": "c1",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
            }
        )

    async def go():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        client = RolloutClient(AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-1", max_retries=0), 0)
        try:
            reply = await client.get_native_response(MSGS, "m", {"max_tokens": 3}, extra_headers={"X-S": "s9"})
            return reply, client.sdk_fallbacks
        finally:
            await client.close()
            await runner.cleanup()

    reply, fallbacks = asyncio.run(go())
    assert isinstance(reply, ChatCompletion) and reply.choices[0].message.content == "ok" and fallbacks == 0
    assert seen["path"] == "/v1/chat/completions" and seen["auth"] == "Bearer sk-1" and seen["session"] == "s9"
    assert seen["body"] == {"model": "m", "messages": MSGS, "max_completion_tokens": 3}
