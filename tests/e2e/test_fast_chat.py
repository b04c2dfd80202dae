"""The chat fast path (cpu/fast_chat.py) answers exactly as FastAPI's route does: the same status and body for good
requests and bad ones, on two servers over one tiny model (real engines, in process, through Starlette's client)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from verifiers_rl.inference.cpu.app import create_app
from verifiers_rl.inference.cpu.engines import load_engine
from verifiers_rl.inference.cpu.fast_chat import ChatFastPath

MSG = [{"role": "user", "content": "Reverse: hello"}]


def _fast_layer(app) -> ChatFastPath | None:
    layer = app.middleware_stack
    while layer is not None and not isinstance(layer, ChatFastPath):
        layer = getattr(layer, "app", None)
    return layer


@pytest.fixture(scope="module")
def clients(tiny_model_dir):
    apps = {fast: create_app(load_engine(tiny_model_dir, max_model_len=64, max_num_seqs=4), "m", fast_chat=fast)
            for fast in (True, False)}  # fmt: skip
    with TestClient(apps[True]) as fast, TestClient(apps[False]) as route:
        yield fast, route


def _comparable(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


GOOD = [
    {"model": "m", "messages": MSG, "max_tokens": 6, "temperature": 0.0, "logprobs": True, "return_token_ids": True},
    {"model": "m", "messages": MSG, "max_completion_tokens": 5, "temperature": 1.2, "seed": 7, "n": 2,
     "logprobs": True, "vendor_extra": {"ignored": True}},
    {"messages": MSG, "max_tokens": 4, "temperature": 0.0, "stop": ["l"]},  # no model: the served one
]  # fmt: skip

BAD = [
    ("unknown model", json.dumps({"model": "nope", "messages": MSG, "max_tokens": 2}), "application/json"),
    ("stream", json.dumps({"model": "m", "messages": MSG, "stream": True}), "application/json"),
    ("context overflow", json.dumps({"model": "m", "messages": MSG, "max_tokens": 500}), "application/json"),
    ("no messages", json.dumps({"model": "m", "max_tokens": 2}), "application/json"),
    ("a wrong type", json.dumps({"model": "m", "messages": MSG, "max_tokens": "many"}), "application/json"),
    ("not JSON", "{not json", "application/json"),
    ("not an object", "[1, 2]", "application/json"),
    ("another content type", json.dumps({"model": "m", "messages": MSG, "max_tokens": 2}), "text/plain"),
]


def test_good_requests_answer_alike_and_take_the_fast_path(clients):
    fast, route = clients
    layer = _fast_layer(fast.app)
    assert layer is not None and _fast_layer(route.app) is None
    for body in GOOD:
        a = fast.post("/v1/chat/completions", json=body)
        b = route.post("/v1/chat/completions", json=body)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert _comparable(a.json()) == _comparable(b.json())
        assert a.headers["content-type"] == b.headers["content-type"]
    assert layer.answered == len(GOOD)


@pytest.mark.parametrize("what,payload,content_type", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_fastapis_own_answer(clients, what, payload, content_type):
    fast, route = clients
    a = fast.post("/v1/chat/completions", content=payload, headers={"content-type": content_type})
    b = route.post("/v1/chat/completions", content=payload, headers={"content-type": content_type})
    assert a.status_code == b.status_code != 200, (what, a.status_code, b.status_code)
    assert a.json() == b.json()


def test_a_query_string_and_other_routes_pass_through(clients):
    fast, route = clients
    body = {"model": "m", "messages": MSG, "max_tokens": 3, "temperature": 0.0}
    layer = _fast_layer(fast.app)
    before = layer.answered
    a = fast.post("/v1/chat/completions?x=1", json=body)
    b = route.post("/v1/chat/completions?x=1", json=body)
    assert a.status_code == b.status_code == 200 and _comparable(a.json()) == _comparable(b.json())
    assert fast.get("/health").json()["status"] == "ok"
    assert layer.answered == before  # FastAPI answered both


async def _drive(layer, scope: dict, messages: list[dict]) -> list[dict]:
    """Call the ASGI layer with these `receive` messages (then disconnects); what it sent back."""
    sent, pending = [], list(messages)

    async def receive():
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await layer(scope, receive, send)
    return sent


def test_a_body_in_chunks_is_one_request_and_a_cut_one_is_left_to_fastapi(clients):
    """The ASGI contract: a body sent in several `http.request` messages is read whole; a client gone mid-body is
    handed on to FastAPI as it arrived (the fast path answers nothing itself)."""
    from starlette.requests import ClientDisconnect

    fast, route = clients
    layer = _fast_layer(fast.app)
    body = json.dumps({"model": "m", "messages": MSG, "max_tokens": 3, "temperature": 0.0}).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 8000), "scheme": "http", "http_version": "1.1", "app": fast.app}  # fmt: skip
    n = len(body) // 3
    parts = [body[:n], body[n : 2 * n], body[2 * n :]]
    chunks = [{"type": "http.request", "body": b, "more_body": i < 2} for i, b in enumerate(parts)]
    before = layer.answered
    sent = fast.portal.call(_drive, layer, scope, chunks)
    assert sent[0]["status"] == 200 and layer.answered == before + 1
    expected = route.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"}).json()
    assert _comparable(json.loads(sent[1]["body"])) == _comparable(expected)
    try:
        sent = fast.portal.call(_drive, layer, scope, [chunks[0], {"type": "http.disconnect"}])
    except ClientDisconnect:  # FastAPI's own reaction to a client gone mid-body (uvicorn drops it)
        sent = []
    assert layer.answered == before + 1 and not any(m.get("status") == 200 for m in sent)
