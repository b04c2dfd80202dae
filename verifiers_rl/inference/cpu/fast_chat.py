"""POST /v1/chat/completions without FastAPI's per-request machinery: the rollouts' hot path.

Why: every rollout turn is one chat request, and the server's HTTP work shares one GIL with the decode loop, so its
CPU time is on the generation's critical path. FastAPI spends more per request than our handler does (route
matching, its request/response wrappers, dependency solving, body parsing and validation in Python);
`benchmarks/bench_server_http.py` measures the difference (docs/performance.md). This ASGI layer answers the common
case, a well-formed JSON request, with the same handler the FastAPI route runs (`openai_routes.chat_completion`);
anything else (a query string, another content type, a body that does not parse
or validate) is replayed to the FastAPI route untouched, so every error keeps FastAPI's exact status and body.

It sits inside the API-key and control guards and FastAPI's body-size limit (it is the innermost user middleware).
"""

from __future__ import annotations

from pydantic import ValidationError
from starlette.responses import JSONResponse

from verifiers_rl.inference.cpu import protocol
from verifiers_rl.inference.cpu.engine_api import ServingEngine
from verifiers_rl.inference.cpu.openai_routes import chat_completion

CHAT_PATH = "/v1/chat/completions"


# Kept by bench_cpu_tunings' row "server CPU per chat request (httptools): FastAPI route vs fast path" (>= 1.1x).
class ChatFastPath:
    def __init__(self, app, engine: ServingEngine, served_model_name: str):
        self.app, self.engine, self.served_model_name = app, engine, served_model_name
        self.answered = 0  # requests this layer answered itself (tests check the common case takes it)

    async def __call__(self, scope, receive, send):
        if not _is_plain_json_post(scope):
            return await self.app(scope, receive, send)
        body, message = await _read_body(receive)
        if message is not None:  # the client went away (or sent something else) before the body ended
            return await self.app(scope, _replay(body, receive, message), send)
        try:
            req = protocol.ChatCompletionRequest.model_validate_json(body)
        except (ValidationError, ValueError):
            return await self.app(scope, _replay(body, receive), send)  # FastAPI's own 422 / 400
        self.answered += 1
        response: JSONResponse = await chat_completion(self.engine, self.served_model_name, req)
        await response(scope, receive, send)


def _is_plain_json_post(scope) -> bool:
    if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != CHAT_PATH or scope["query_string"]:
        return False
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


async def _read_body(receive) -> tuple[bytes, dict | None]:
    """The whole request body, or what arrived of it and the message that interrupted it."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), message
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), None


def _replay(body: bytes, receive, then: dict | None = None):
    """A `receive` that hands the downstream app the body already read, then what `then` was, then the rest."""
    pending = [{"type": "http.request", "body": body, "more_body": then is not None}]
    if then is not None:
        pending.append(then)

    async def replayed():
        return pending.pop(0) if pending else await receive()

    return replayed
