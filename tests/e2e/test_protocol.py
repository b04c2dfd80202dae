"""One conformance suite, two engines: our CPU engine always; real vLLM (CPU build) when VF_VLLM_PYTHON is set.

Everything goes over real HTTP through the `openai` client or httpx, and weight syncs over real gloo.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from openai import AsyncOpenAI, OpenAI
from servers import ENGINES, start_server
from transformers import AutoModelForCausalLM, AutoTokenizer

from verifiers_rl.tiny import build_tiny_model

MSG = [{"role": "user", "content": "Reverse: hello"}]


@pytest.fixture(scope="module", params=ENGINES)
def server(request, tiny_model_dir, tmp_path_factory):
    if request.param == "vllm":
        srv = request.getfixturevalue("vllm_server")  # the session's, shared with test_engine_robustness
    else:
        srv = start_server(request.param, tiny_model_dir, tmp_path_factory.mktemp(f"srv-{request.param}"))
    srv.engine_name = request.param
    yield srv
    if request.param != "vllm":
        srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    return OpenAI(base_url=server.base_url + "/v1", api_key="x")


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), AutoTokenizer.from_pretrained(tiny_model_dir)


def _chat(oai, model, **kw):
    body = dict(model=model, messages=MSG, max_tokens=12, logprobs=True, extra_body={"return_token_ids": True})
    body.update(kw)
    return oai.chat.completions.create(**body)


def _teacher_forced(model, prompt_ids, completion_ids, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + completion_ids])).logits[0, len(prompt_ids) - 1 : -1]
    lp = torch.log_softmax(logits.float() / temperature, -1)
    return lp.gather(1, torch.tensor(completion_ids)[:, None]).squeeze(1), logits


def test_models_route(server, oai, tiny_model_dir):
    ids = [m.id for m in oai.models.list().data]
    assert tiny_model_dir in ids


def test_chat_returns_vllm_token_fields(server, oai, hf, tiny_model_dir):
    _, tok = hf
    r = _chat(oai, tiny_model_dir, max_tokens=10, seed=1, temperature=1.0)
    choice = r.choices[0]
    prompt_ids = r.model_extra["prompt_token_ids"]
    token_ids = choice.model_extra["token_ids"]
    assert prompt_ids == tok.apply_chat_template(MSG, add_generation_prompt=True)["input_ids"]
    assert len(token_ids) == len(choice.logprobs.content) >= 1
    assert all(c.logprob <= 0 for c in choice.logprobs.content)
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == len(token_ids)
    if len(token_ids) == 10:
        assert choice.finish_reason == "length"


def test_logprobs_are_processed_at_temperature(server, oai, hf, tiny_model_dir):
    model, _ = hf
    r = _chat(oai, tiny_model_dir, max_tokens=16, temperature=0.7, seed=3)
    prompt_ids, ids = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
    ref, _ = _teacher_forced(model, prompt_ids, ids, temperature=0.7)
    got = torch.tensor([c.logprob for c in r.choices[0].logprobs.content])
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


def test_greedy_equals_hf_argmax(server, oai, hf, tiny_model_dir):
    model, _ = hf
    r = _chat(oai, tiny_model_dir, max_tokens=12, temperature=0)
    prompt_ids, ids = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
    _, logits = _teacher_forced(model, prompt_ids, ids)
    assert ids == logits.argmax(-1).tolist()


def test_seeded_requests_reproduce(server, oai, tiny_model_dir):
    a = _chat(oai, tiny_model_dir, max_tokens=16, seed=11).choices[0].model_extra["token_ids"]
    b = _chat(oai, tiny_model_dir, max_tokens=16, seed=11).choices[0].model_extra["token_ids"]
    assert a == b


def test_n_choices(server, oai, tiny_model_dir):
    r = _chat(oai, tiny_model_dir, n=3, max_tokens=8, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    seqs = {tuple(c.model_extra["token_ids"]) for c in r.choices}
    assert len(seqs) > 1


def test_stop_string_truncates(server, oai, tiny_model_dir):
    full = _chat(oai, tiny_model_dir, max_tokens=24, temperature=0).choices[0]
    text = full.message.content
    stop = next((ch for ch in text[3:] if ch.isascii() and ch.isprintable() and ch.strip()), None)
    if stop is None:
        pytest.skip("greedy text has no printable ASCII to stop on")
    cut = text.index(stop, 3) if stop in text[3:] else text.index(stop)
    r = _chat(oai, tiny_model_dir, max_tokens=24, temperature=0, stop=[stop]).choices[0]
    assert r.finish_reason == "stop"
    assert stop not in r.message.content
    assert text.startswith(r.message.content)
    assert len(r.message.content) <= cut


def test_completions_route(server, oai, hf, tiny_model_dir):
    _, tok = hf
    r = oai.completions.create(
        model=tiny_model_dir, prompt="abc", max_tokens=6, logprobs=0, seed=2, extra_body={"return_token_ids": True}
    )
    c = r.choices[0]
    assert c.model_extra["prompt_token_ids"] == tok("abc", add_special_tokens=False)["input_ids"]
    assert len(c.model_extra["token_ids"]) == len(c.logprobs.token_logprobs)
    r2 = oai.completions.create(model=tiny_model_dir, prompt=[97, 98, 99], max_tokens=6, seed=2)
    assert r2.choices[0].text == c.text


def test_context_overflow_is_a_400(server, oai, tiny_model_dir):
    with pytest.raises(Exception) as err:
        _chat(oai, tiny_model_dir, max_tokens=5000)
    assert getattr(err.value, "status_code", None) == 400


def test_32_concurrent_requests_complete(server, tiny_model_dir):
    async def go():
        client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x")
        rs = await asyncio.gather(
            *[
                client.chat.completions.create(
                    model=tiny_model_dir, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=16, seed=i
                )
                for i in range(32)
            ]
        )
        await client.close()
        return rs

    rs = asyncio.run(go())
    assert len(rs) == 32
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in rs)


def test_an_idle_connection_outlives_the_clients_keep_alive(server):
    """The OpenAI client (httpx) drops an idle connection after 5 s; the server must not close it sooner, or a
    connection reused across a training step races the server's close ("Server disconnected")."""
    import socket
    import time
    from urllib.parse import urlsplit

    url = urlsplit(server.base_url)
    request = f"GET /v1/models HTTP/1.1\r\nHost: {url.hostname}\r\n\r\n".encode()
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        stream = sock.makefile("rb")
        for idle in (6, 0):  # 6 s: longer than uvicorn's and vLLM's 5 s default keep-alive; none after the last
            sock.sendall(request)
            status = stream.readline()  # empty when the server closed the connection
            assert status.startswith(b"HTTP/1.1 200"), status
            headers = dict(line.decode().strip().lower().split(": ", 1) for line in iter(stream.readline, b"\r\n"))
            stream.read(int(headers["content-length"]))
            time.sleep(idle)


def test_control_routes_need_the_token(server):
    r = httpx.post(server.base_url + "/pause")
    assert r.status_code == 401
    r = httpx.get(server.base_url + "/is_paused", headers={"Authorization": f"Bearer {server.token}"})
    assert r.status_code == 200 and r.json()["is_paused"] is False


def _live_routes(server) -> list[tuple[str, str]]:
    """(method, path) of every route the running server mounts, read from its own table (/openapi.json, itself
    behind the token), path parameters filled in."""
    import re

    r = httpx.get(server.base_url + "/openapi.json", headers={"Authorization": f"Bearer {server.token}"}, timeout=30)
    assert r.status_code == 200, r.text[:300]
    return [
        (method.upper(), re.sub(r"\{[^}]+\}", "x", path))
        for path, ops in r.json()["paths"].items()
        for method in ops
        if method in ("get", "post", "put", "delete", "patch")
    ]


def test_every_route_that_is_not_inference_refuses_a_caller_without_the_token(server, oai, tiny_model_dir):
    """Against the server's live route table: whatever the engine (and its version) mounts besides inference answers
    401 without the token or with a wrong one, before the route runs. vLLM's `/weight_checker` reset, which zeroes
    every weight, leaves the weights as they were."""
    from verifiers_rl.serving.auth import INFERENCE_ROUTES

    before = _chat(oai, tiny_model_dir, temperature=0, max_tokens=8).choices[0].token_ids
    routes = _live_routes(server)
    guarded = [(m, p) for m, p in routes if p not in INFERENCE_ROUTES]
    paths = {p for _, p in guarded}
    assert {"/pause", "/update_weights", "/collective_rpc"} <= paths
    if server.engine_name == "vllm":  # VLLM_SERVER_DEV_MODE=1 mounts these too
        assert {"/weight_checker", "/release_kv_cache_memory", "/server_info", "/reset_mm_cache"} <= paths, paths
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        for method, path in guarded + [("POST", "/weight_checker"), ("GET", "/openapi.json")]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-VF-Control-Token": "wrong"}):
                r = http.request(method, path, json={"action": "reset"}, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.status_code, r.text[:200])
    assert _chat(oai, tiny_model_dir, temperature=0, max_tokens=8).choices[0].token_ids == before


def test_pause_resume(server):
    client = server.client
    client.pause("keep")
    assert client.is_paused()
    client.resume()
    assert not client.is_paused()
    assert client.get_world_size() >= 1


def test_verifiers_env_generate_gets_trajectory_tokens(server, tiny_model_dir):
    import verifiers as vf
    from datasets import Dataset

    ds = Dataset.from_list([{"question": f"say {w}", "answer": w} for w in ["cat", "dog"]])
    env = vf.SingleTurnEnv(
        dataset=ds, rubric=vf.Rubric(funcs=[lambda completion, answer, **kw: float(len(str(completion)))])
    )
    client = vf.OpenAIChatCompletionsClient(AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x"))
    sampling = {"max_tokens": 8, "temperature": 1.0, "logprobs": True, "extra_body": {"return_token_ids": True}}
    out = asyncio.run(
        env.generate(
            env.get_dataset().repeat(2), client, tiny_model_dir, sampling_args=sampling, state_columns=["trajectory"]
        )
    )
    rollouts = out["outputs"]
    assert sorted(r["example_id"] for r in rollouts) == [0, 0, 1, 1]
    for r in rollouts:
        assert r["error"] is None
        tokens = r["trajectory"][0]["tokens"]
        assert tokens is not None, "server response lacked the fields verifiers needs for token data"
        assert len(tokens["completion_ids"]) == len(tokens["completion_logprobs"]) >= 1
        assert tokens["prompt_ids"][0] == 257  # <|im_start|>
        assert r["is_truncated"] == (len(tokens["completion_ids"]) == 8 and tokens["completion_ids"][-1] != 258)


def test_merged_sync_matches_trainer_model(server, oai, tiny_model_dir):
    """Runs last in this module: it changes the served weights."""
    client = server.client
    perturbed, _ = build_tiny_model(seed=1)
    client.init_weight_transfer(bucket_bytes=64 * 1024)  # several buckets
    before = client.weight_version()
    stats = client.update_weights(perturbed.named_parameters(), version=7)
    assert stats.buckets > 1 and stats.tensors == len(list(perturbed.parameters()))
    assert client.weight_version() == "7" != before
    r = _chat(oai, tiny_model_dir, max_tokens=12, temperature=0.8, seed=4)
    prompt_ids, ids = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
    ref, _ = _teacher_forced(perturbed, prompt_ids, ids, temperature=0.8)
    got = torch.tensor([c.logprob for c in r.choices[0].logprobs.content])
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
    if server.engine_name == "cpu":
        assert r.model_extra["policy_version"] == 7


def _rollout_client_replies(server, model, lean: bool, sampling: dict, n: int = 6):
    """n seeded rollout requests through RolloutClient (the trainer's client), lean path or the SDK's."""
    from verifiers_rl.rollouts.client import ROLLOUT_KEY, RolloutClient

    async def go():
        client = RolloutClient(AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0), 7, lean=lean)
        try:
            states = [{"input": {ROLLOUT_KEY: f"0:0:{i}"}} for i in range(n)]
            replies = await asyncio.gather(*[client.get_native_response(MSG, model, sampling, state=s) for s in states])
            parsed = [await client.from_native_response(r) for r in replies]
            return replies, parsed, states, client.sdk_fallbacks
        finally:
            await client.close()

    return asyncio.run(go())


def test_rollout_client_lean_path_equals_the_sdk_path(server, tiny_model_dir):
    """The trainer's lean request path sends what the SDK sends and parses to the same verifiers Response: same
    seeded tokens, logprobs, finish reasons, policy version; and the server's replies need no SDK fallback."""
    from verifiers_rl.rollouts.rollouts import POLICY_VERSIONS_KEY
    from verifiers_rl.trainer import RLConfig

    args = RLConfig(output_dir="unused", use_cpu=True, max_tokens=10, top_k=50, min_p=0.01, report_to="none")
    sampling = args.sampling_args
    lean, lean_parsed, lean_states, fallbacks = _rollout_client_replies(server, tiny_model_dir, True, sampling)
    sdk, sdk_parsed, _, sdk_fallbacks = _rollout_client_replies(server, tiny_model_dir, False, sampling)
    assert fallbacks == 0 and sdk_fallbacks == len(sdk)
    assert type(lean[0]) is type(sdk[0])
    for a, b in zip(lean_parsed, sdk_parsed):
        assert a.message.tokens.completion_ids == b.message.tokens.completion_ids
        assert a.message.tokens.prompt_ids == b.message.tokens.prompt_ids
        assert a.message.tokens.completion_logprobs == pytest.approx(b.message.tokens.completion_logprobs, abs=1e-4)
        assert (a.message.content, a.message.finish_reason) == (b.message.content, b.message.finish_reason)
    assert len({tuple(p.message.tokens.completion_ids) for p in lean_parsed}) > 1  # per-rollout seeds differ
    if server.engine_name == "cpu":  # vLLM's replies carry no policy version
        served = sdk[0].model_extra["policy_version"]  # earlier tests in this module may have synced weights
        assert isinstance(served, int) and all(s[POLICY_VERSIONS_KEY] == [served] for s in lean_states)


def test_rollout_client_errors_are_the_sdks(server, tiny_model_dir):
    """Errors through the lean path are the ones the SDK path raises (verifiers classifies them): a 400 for too many
    tokens, an over-long prompt (verifiers' OverlongPromptError where the server's text says so), no server."""
    from openai import APIConnectionError, BadRequestError
    from verifiers.errors import OverlongPromptError

    from verifiers_rl.config.net import free_port
    from verifiers_rl.rollouts.client import RolloutClient

    def error(base_url, prompt, sampling, lean):
        async def go():
            client = RolloutClient(AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=10), 0, lean=lean)
            try:
                await client.get_native_response(prompt, tiny_model_dir, sampling)
            finally:
                await client.close()

        with pytest.raises(Exception) as err:
            asyncio.run(go())
        return err.value

    url = server.base_url + "/v1"
    long_prompt = [{"role": "user", "content": "x" * 3000}]
    for prompt, sampling in ((MSG, {"max_tokens": 5000}), (long_prompt, {"max_tokens": 4})):
        lean, sdk = error(url, prompt, sampling, True), error(url, prompt, sampling, False)
        assert isinstance(lean, (BadRequestError, OverlongPromptError))
        assert (type(lean), str(lean), str(lean.__cause__)) == (type(sdk), str(sdk), str(sdk.__cause__))
    assert isinstance(error(f"http://127.0.0.1:{free_port()}/v1", MSG, {"max_tokens": 4}, True), APIConnectionError)


def test_the_server_says_what_it_serves_and_how_it_receives(server, tiny_model_dir):
    """What a trainer checks before it connects (serving/identity.py), asked of the real engines' workers."""
    from transformers import AutoConfig

    from verifiers_rl.serving.identity import describe, differences, served_model

    served = served_model(server.client)
    assert served == {"config": describe(AutoConfig.from_pretrained(tiny_model_dir)), "backend": "gloo"}
    assert served["config"]["hidden_size"] == 64 and served["config"]["num_hidden_layers"] == 2
    fatal, _ = differences(served, AutoConfig.from_pretrained(tiny_model_dir), transport="nccl", changed_only=True,
                           served_name=tiny_model_dir, model_path=tiny_model_dir)  # fmt: skip
    assert fatal == ["it receives weights over 'gloo', the trainer sends over 'sparse_nccl'"]
