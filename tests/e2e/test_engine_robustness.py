"""Bad requests over real HTTP against the CPU server (both engine loops) and, when VF_VLLM_PYTHON is set, real
vLLM: a 400 or 404 for that request, and the server keeps serving. Before: an out-of-vocabulary token id got a 500
from the CPU server, after which /health said ok while every generation timed out."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest
from servers import ENGINES

from verifiers_rl.plan.layout import ADAPTER_NAME
from verifiers_rl.serving.launcher import InferenceServer


@pytest.fixture(scope="module", params=["slots", "cb", *ENGINES[1:]])
def server(request, tiny_model_dir, tmp_path_factory):
    if request.param == "vllm":
        srv = request.getfixturevalue("vllm_server")  # the session's; stopped at its end
    else:
        out = tmp_path_factory.mktemp(f"robust-{request.param}")
        srv = InferenceServer(tiny_model_dir, engine="cpu", output_dir=out,
                              extra_args=["--max-model-len", "256", "--cpu-engine", request.param])  # fmt: skip
        srv.start()
    srv.kind = request.param
    yield srv
    if request.param != "vllm":
        srv.stop()


def _error(r) -> dict:
    body = r.json()
    return body.get("error", body)  # vLLM nests the error object, the CPU server does not


def _complete(server, model, prompt, **kw):
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "ignore_eos": True, **kw}
    return httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)


@pytest.mark.parametrize("prompt, bad", [([1, 2, 10_000], 10_000), ([5, -1], -1)])
def test_out_of_vocabulary_ids_are_400_and_the_server_keeps_serving(server, tiny_model_dir, prompt, bad):
    r = _complete(server, tiny_model_dir, prompt)
    assert r.status_code == 400, r.text
    if bad >= 0 or server.kind != "vllm":  # vLLM's request schema refuses negative ids in its own words
        assert f"Token id {bad} is out of vocabulary" in _error(r)["message"]
    ok = _complete(server, tiny_model_dir, [97, 98, 99])
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"].encode()) >= 1
    health = httpx.get(server.base_url + "/health")
    assert health.status_code == 200 and (server.kind == "vllm" or health.json()["status"] == "ok")


def test_bad_requests_among_good_ones_fail_alone(server, tiny_model_dir):
    async def go():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            bodies = [{"model": tiny_model_dir, "prompt": [97 + i % 20] * 5, "max_tokens": 8, "ignore_eos": True}
                      for i in range(12)]  # fmt: skip
            bodies[3]["prompt"] = [1, 99999]
            bodies[7]["max_tokens"] = 10_000
            return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))

    codes = [r.status_code for r in asyncio.run(go())]
    assert codes == [200] * 3 + [400] + [200] * 3 + [400] + [200] * 4


def test_a_cpu_server_we_start_logs_no_line_per_request(server, tiny_model_dir):
    if server.kind == "vllm":
        pytest.skip("a vLLM server we start keeps vLLM's own logging")
    assert _complete(server, tiny_model_dir, [97, 98, 99]).status_code == 200
    log = server.log_path.read_text(errors="replace")
    assert "Uvicorn running on" in log  # the server's own lines still reach its log
    assert "/v1/completions" not in log and "/health" not in log


def test_unknown_model_is_404_like_vllm(server, tiny_model_dir):
    r = _complete(server, "no-such-model", [97, 98])
    assert r.status_code == 404
    assert _error(r)["type"] == "NotFoundError" and "The model `no-such-model` does not exist." in _error(r)["message"]
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                   json={"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert r.status_code == 404
    assert _complete(server, tiny_model_dir, [97, 98]).status_code == 200
    if server.kind != "vllm":  # adapter sync: the trainer's rollouts name the policy adapter, served by the CPU engine
        assert _complete(server, ADAPTER_NAME, [97, 98]).status_code == 200


def test_dead_generation_loop_makes_health_fail(tiny_model_dir):
    """In process (a subprocess server's loop cannot be killed from here): /health is 503 once the loop is gone,
    and requests fail at once with a 500 instead of hanging."""
    from fastapi.testclient import TestClient

    from verifiers_rl.inference.cpu.app import create_app
    from verifiers_rl.inference.cpu.engines import load_engine

    engine = load_engine(tiny_model_dir, max_model_len=128, max_num_seqs=2)

    def boom():
        raise RuntimeError("bug in the loop")

    with TestClient(create_app(engine, "m")) as client:
        assert client.get("/health").json()["status"] == "ok"
        engine._compact = boom
        r = client.post("/v1/completions", json={"model": "m", "prompt": [97], "max_tokens": 2})
        assert r.status_code == 500 and "loop died" in r.json()["message"]
        engine._thread.join(5)
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"model": "m", "prompt": [97], "max_tokens": 2})
        assert r.status_code == 500 and "not running" in r.json()["message"]


def test_a_paused_slot_engine_server_stops_on_sigterm(tiny_model_dir, tmp_path):
    """/pause and /resume run on whichever worker thread is free; the server still shuts down on SIGTERM, paused
    or not (transformers' continuous batching binds its pause to the pausing thread and then refused to stop)."""
    srv = InferenceServer(tiny_model_dir, engine="cpu", output_dir=tmp_path,
                          extra_args=["--max-model-len", "256", "--cpu-engine", "slots"])  # fmt: skip
    client = srv.start()
    try:
        for _ in range(3):
            client.pause()
            client.resume()
        client.pause()
        assert client.is_paused()
        t0 = time.monotonic()
        srv.process.send_signal(signal.SIGTERM)
        srv.process.wait(20)
        assert time.monotonic() - t0 < 10  # 2-3 s here
    finally:
        srv.stop()
