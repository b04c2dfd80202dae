"""Conformance against real vLLM (the CPU build): our `gloo` weight-transfer plugin, the RL HTTP routes,
several workers, and adapter sync into vLLM's LoRA slots.

Skipped unless VF_VLLM_PYTHON names the python of a venv with vLLM >= 0.32 and this package installed
(`pip install --no-deps -e .` there registers the plugin's entry point). The trainer side runs here.

Three servers, one at a time (a start costs 30-90 s on two cores): data parallel 2 (`TestTwoEngines`), tensor
parallel 2 with a tied lm_head, and one in adapter mode with data parallel 2 started through our launcher (`lora`
fixture; its worker extension is ours plus a refusal on demand, tests/scripts/vllm_test_extension.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from servers import NEEDS_VLLM, VLLM_PYTHON

pytestmark = NEEDS_VLLM

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 240
# Small enough that the tiny model spans many buckets and q/k/v of one layer land in different ones.
BUCKET_BYTES = 12 * 1024
PROMPT = [{"role": "user", "content": "Count: one two three"}]
MAX_TOKENS = 12
LONG = 2000  # tokens: seconds of decoding for the two-engine server (--max-model-len 2048 there)
PROMPTS = ([72, 101, 108, 108, 111], [1, 2, 3, 4, 5, 6], [200, 100, 50])  # token ids, for /v1/completions


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "<no log>"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _omp_bind(workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` local workers. The CPU build's default ("auto") gives each TP
    worker its own NUMA node and dies on a single-node host; explicit core lists (one per worker, in DP, PP, TP
    order) work, and may overlap when the host has fewer cores than workers."""
    cores = sorted(os.sched_getaffinity(0))
    lists = [cores[i::workers] or [cores[i % len(cores)]] for i in range(workers)]
    return "|".join(",".join(map(str, c)) for c in lists)


@contextlib.contextmanager
def _vllm_server(model_dir: str, log_path: Path, extra=(), env=None):
    """Start real vLLM with the gloo backend on a free loopback port; always kill its process group."""
    import httpx

    from verifiers_rl.inference.vllm_command import build_vllm_command

    port = _free_port()
    argv, env_add = build_vllm_command(
        model_dir,
        HOST,
        port,
        extra_args=["--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--max-num-seqs", "16", *extra],
        weight_backend="gloo",
        python=VLLM_PYTHON,
    )
    env = {**os.environ, **env_add, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        # Own session, so teardown can kill the engine-core child along with the API server.
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with httpx.Client(base_url=f"http://{HOST}:{port}", timeout=httpx.Timeout(120.0, connect=5.0)) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited with {proc.returncode}:\n{_tail(log_path)}")
                if time.monotonic() - t0 > STARTUP_TIMEOUT_S:
                    raise RuntimeError(f"vLLM not healthy after {STARTUP_TIMEOUT_S}s:\n{_tail(log_path)}")
                try:
                    if client.get("/health", timeout=2.0).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            print(f"\nvLLM healthy after {time.monotonic() - t0:.1f}s")
            yield {"client": client, "model": model_dir, "log": log_path}
    finally:
        _stop(proc)


@pytest.fixture(scope="class")
def server(tiny_model_dir, tmp_path_factory):
    """Two data-parallel engines of one worker each: requests reach either, every sync must reach both.
    Class scope: the server is gone before the next one starts."""
    log = tmp_path_factory.mktemp("vllm_dp2") / "vllm.log"
    env = {"VLLM_CPU_OMP_THREADS_BIND": _omp_bind(2)}  # one core each; "auto" pins both engines to core 0
    with _vllm_server(tiny_model_dir, log, ["--data-parallel-size", "2", "--max-model-len", "2048"], env) as srv:
        yield srv


def _tied_tiny_model(seed: int):
    """The tiny model with lm_head tied to the embedding: the layout whose CPU reload needs a re-pack."""
    from transformers import GenerationConfig, Qwen3ForCausalLM

    from verifiers_rl.tiny import TinySpec, build_config, build_tokenizer

    tokenizer = build_tokenizer()
    config = build_config(tokenizer, TinySpec(seed=seed))
    config.tie_word_embeddings = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval(), tokenizer


def _ok(resp):
    assert resp.status_code == 200, f"{resp.request.method} {resp.request.url}: {resp.status_code} {resp.text}"
    return resp.json()


def _chat(server, temperature: float, dp_rank: int | None = None):
    # vLLM routes a request to the data-parallel engine this header names (else it load-balances)
    headers = {} if dp_rank is None else {"X-data-parallel-rank": str(dp_rank)}
    return _ok(
        server["client"].post(
            "/v1/chat/completions",
            headers=headers,
            json={
                "model": server["model"],
                "messages": PROMPT,
                "max_tokens": MAX_TOKENS,
                "temperature": temperature,
                "logprobs": True,
                "return_token_ids": True,
            },
        )
    )


def _hf_reference(model, prompt_ids: list[int], completion_ids: list[int]):
    """HF greedy continuation of the prompt, and teacher-forced logprobs of `completion_ids`."""
    with torch.no_grad():
        inp = torch.tensor([prompt_ids])
        greedy = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=MAX_TOKENS)
        full = torch.tensor([prompt_ids + completion_ids])
        logp = torch.log_softmax(model(full).logits[0].double(), dim=-1)
    n = len(prompt_ids)
    forced = [logp[n - 1 + i, tok].item() for i, tok in enumerate(completion_ids)]
    return greedy[0, n:].tolist(), forced


def test_plugin_registers_in_vllm_venv():
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins(); load_general_plugins()\n"
        "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F\n"
        "from vllm.distributed.weight_transfer.base import WeightTransferEngine\n"
        "cls = F._registry['gloo']()\n"
        "assert issubclass(cls, WeightTransferEngine), cls\n"
        "from verifiers_rl.inference.vllm_command import check_vllm\n"
        "print(cls.__name__, check_vllm())\n"
    )
    out = subprocess.run([VLLM_PYTHON, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    name, version = out.stdout.split()[-2:]
    assert name == "GlooWeightTransferEngine"
    assert tuple(int(x) for x in version.split("+")[0].split(".")[:2]) >= (0, 32)


class TestTwoEngines:
    def test_world_size_counts_every_engine(self, server):
        # TP x PP x DP: the trainer's gloo world is 1 + this
        assert _ok(server["client"].get("/get_world_size")) == {"world_size": 2}

    def test_chat_returns_token_ids_and_logprobs(self, server):
        _check_chat_fields(server)

    def test_gloo_sync_matches_hf_on_every_engine(self, server):
        from verifiers_rl.tiny import build_tiny_model

        client = server["client"]
        original, _ = build_tiny_model(seed=0)
        perturbed, _ = build_tiny_model(seed=1)
        _check_serves(server, original, perturbed, dp_ranks=(0, 1))
        with _trainer_group(client, BUCKET_BYTES) as (pg, pool):
            assert pg.world_size == 3
            # Forth and back: a second sync proves the reload lifecycle can repeat.
            for version, model, other in ((1, perturbed, original), (2, original, perturbed)):
                assert _sync(client, pg, pool, model, version, BUCKET_BYTES) >= 8
                _check_serves(server, model, other, dp_ranks=(0, 1))

    def test_a_sync_under_running_requests_leaves_no_stale_prefix(self, server):
        """While running requests hold KV blocks vLLM refuses a plain prefix-cache reset (200, success false), and a
        prompt cached before the sync is then served from keys and values of the old weights. vLLM 0.32's engine
        core happens to clear its caches when it pauses with mode=keep (its route's docstring says keep ignores
        clear_cache); this pause skips that, so the sender's own reset has to do the job. Both engines run
        requests through the sync; the prompt is cached on engine 0."""
        from verifiers_rl.serving.client import InferenceClient
        from verifiers_rl.tiny import build_tiny_model

        http, name = server["client"], server["model"]
        original, perturbed = build_tiny_model(seed=0)[0], build_tiny_model(seed=1)[0]
        # longer than one KV block (128 tokens on vLLM's CPU backend): only full blocks are cached
        prompt = torch.randint(3, 250, (200,), generator=torch.Generator().manual_seed(5)).tolist()
        engine0 = {"X-data-parallel-rank": "0"}
        client = InferenceClient(base_url=str(http.base_url), sync_timeout=120)
        try:
            client.init_weight_transfer("gloo", bucket_bytes=BUCKET_BYTES)
            client.update_weights(original.named_parameters(), version=10)

            # The engines run ahead of the API server that reports them (its gauges and responses lag; under load
            # /metrics alone took seconds), so no timing seen from here says requests are still running when a sync
            # lands (CI: a fixed 0.3 s sleep lost that race). So the requests are queued in paused engines, which
            # resume and pause again a round trip later, mid-decode, and vLLM itself says whether they hold KV
            # blocks: a plain prefix-cache reset answers success=false then. When it succeeds instead, the requests
            # had not reached the engines before the resume (and the cached prompt is gone): try again, waiting longer.
            def run_long(pool):
                # no logprobs: less work for the API server
                body = {"model": name, "max_tokens": LONG, "temperature": 0.0, "ignore_eos": True}
                return [
                    pool.submit(
                        http.post,
                        "/v1/completions",
                        json={**body, "prompt": PROMPTS[i % 3]},
                        headers={"X-data-parallel-rank": str(i % 2)},
                    )
                    for i in range(8)
                ]

            def pause():
                client.post("/pause", params={"mode": "keep", "clear_cache": "false"})

            for attempt, wait in enumerate((0.5, 2.0, 5.0, 10.0), 1):
                _complete(http, name, prompt, max_tokens=2, headers=engine0)  # cached under `original`
                with ThreadPoolExecutor(8) as pool:
                    pause()
                    futs = run_long(pool)
                    time.sleep(wait)  # they reach the paused engines' queues
                    client.resume()
                    pause()
                    try:
                        held = client.post("/reset_prefix_cache")["success"] is False
                        if held:
                            client.sender.send(perturbed.named_parameters(), 11)
                    finally:
                        client.resume()
                    answers = [f.result(timeout=300) for f in futs]
                if held:
                    break
                print(f"attempt {attempt}: the requests reached the engines after {wait}s; again")
            else:
                pytest.fail("the requests never ran when the sync landed: the case was never tested")
            # preempted by the sender's reset, then finished
            assert [(a.status_code, a.json()["usage"]["completion_tokens"]) for a in answers] == [(200, LONG)] * 8
            assert _max_diff(http, name, perturbed, prompts=[prompt], headers=engine0) < 1e-4
        finally:
            client.close()

    def test_a_sync_of_changes_only_is_drained_and_refused(self, server):
        """vLLM's CPU build keeps its linear layers only repacked, so a sync of changes cannot be written in place
        (sync/delta.py `Receiving.through`; on a GPU it is, tests/e2e/test_sync_changes_vllm.py): every worker
        drains it and refuses at once, with the reason; the group stays usable and the next sync is whole."""
        from verifiers_rl.serving.client import InferenceClient, ServerError
        from verifiers_rl.tiny import build_tiny_model

        client = InferenceClient(base_url=str(server["client"].base_url), sync_timeout=90)
        try:
            sender = client.init_weight_transfer("gloo", bucket_bytes=BUCKET_BYTES, changed_only=True)
            original, perturbed = build_tiny_model(seed=0)[0], build_tiny_model(seed=1)[0]
            client.update_weights(original.named_parameters(), version=20)  # whole: the snapshot is recorded
            assert sender.changes.version == 20
            t0 = time.monotonic()
            with pytest.raises(ServerError, match=r"refused by the server \(inference rank 1 and 1 more\).*repacked"):
                client.update_weights(perturbed.named_parameters(), version=21)
            assert time.monotonic() - t0 < 30  # not the 90 s group timeout
            assert sender.changes.version is None and client.health() and not client.is_paused()
            client.update_weights(original.named_parameters(), version=22)  # whole again, verified
            _check_serves(server, original, perturbed, dp_ranks=(0, 1))
        finally:
            client.close()

    def test_a_tensor_the_model_lacks_fails_the_sync_at_once(self, server):
        """The workers keep receiving after a failed load, so the trainer hears the reason instead of
        broadcasting into the void until the group timeout. Last in the class: the weights are undefined after."""
        from verifiers_rl.serving.client import InferenceClient, ServerError
        from verifiers_rl.tiny import build_tiny_model

        tensors = list(build_tiny_model(seed=0)[0].named_parameters())
        bad = tensors[:1] + [("model.layers.0.mlp.no_such_proj.weight", torch.zeros(64, 64))] + tensors[1:]
        client = InferenceClient(base_url=str(server["client"].base_url), sync_timeout=90)
        try:
            client.init_weight_transfer("gloo", bucket_bytes=BUCKET_BYTES)
            t0 = time.monotonic()
            with pytest.raises(ServerError, match="refused by the server.*no module or parameter named") as err:
                client.update_weights(bad, version=12)
            print(f"refused in {time.monotonic() - t0:.1f}s: {err.value}")
            assert time.monotonic() - t0 < 30  # not the 90 s group timeout
            assert client.health() and not client.is_paused()
        finally:
            client.close()


def test_checksums_of_every_engine_are_compared(tiny_model_dir, tmp_path):
    """Data-parallel engine 1 (gloo rank 2) drops one bucket on purpose ($VF_TEST_SYNC_FAULT, honoured by our gloo
    receive path): vLLM's HTTP answer comes from engine 0, which loaded everything, yet the sync fails naming rank
    2 and the tensors it never handed to load_weights; engine 0's own report, read from the store, was clean."""
    from verifiers_rl.serving.client import InferenceClient
    from verifiers_rl.sync.buckets import TensorMeta, plan_buckets
    from verifiers_rl.sync.verify import FAULT_ENV, SyncMismatch
    from verifiers_rl.tiny import build_tiny_model

    model = build_tiny_model(seed=1)[0]
    lost = plan_buckets([TensorMeta(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()], BUCKET_BYTES)[1]
    env = {"VLLM_CPU_OMP_THREADS_BIND": _omp_bind(2), FAULT_ENV: "skip-bucket:1@2"}
    with _vllm_server(tiny_model_dir, tmp_path / "vllm.log", ["--data-parallel-size", "2"], env) as srv:
        client = InferenceClient(base_url=str(srv["client"].base_url), sync_timeout=120)
        try:
            client.init_weight_transfer("gloo", bucket_bytes=BUCKET_BYTES)
            with pytest.raises(SyncMismatch) as err:
                client.update_weights(model.named_parameters(), version=3)
            print(err.value)
            line = str(err.value)
            n = len(lost.metas)
            assert f"did not land on inference rank 2: {n} tensor{'s were' if n > 1 else ' was'} never loaded (" in line
            assert f"{lost.metas[0].name}" in line and f"; {sum(m.nbytes for m in lost.metas)} of the sync's " in line
        finally:
            client.close()


def _check_chat_fields(server):
    from verifiers_rl.tiny import build_tokenizer

    body = _chat(server, temperature=1.0)
    assert len(body["choices"]) == 1
    choice = body["choices"][0]
    expected_prompt = build_tokenizer().apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected_prompt, list):
        expected_prompt = expected_prompt["input_ids"]
    assert body["prompt_token_ids"] == list(expected_prompt)
    assert 0 < len(choice["token_ids"]) <= MAX_TOKENS
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"])
    assert all(isinstance(c["logprob"], float) and c["logprob"] <= 0.0 for c in content)


def _check_serves(server, model, other, dp_ranks=(None,)):
    """Greedy tokens equal HF's for `model`, logprobs match its teacher-forced ones, and not `other`'s."""
    for rank in dp_ranks:
        body = _chat(server, temperature=0.0, dp_rank=rank)
        prompt_ids, tokens = body["prompt_token_ids"], body["choices"][0]["token_ids"]
        served = [c["logprob"] for c in body["choices"][0]["logprobs"]["content"]]
        greedy, forced = _hf_reference(model, prompt_ids, tokens)
        assert tokens == greedy, f"engine {rank}"
        assert max(abs(a - b) for a, b in zip(served, forced)) < 1e-4, f"engine {rank}"
        # The comparison must be able to tell the two weight sets apart.
        _, forced_other = _hf_reference(other, prompt_ids, tokens)
        assert max(abs(a - b) for a, b in zip(served, forced_other)) > 1e-2


@contextlib.contextmanager
def _trainer_group(client, bucket_bytes: int):
    """Rank 0 of the gloo group, formed concurrently with the server's /init_weight_transfer_engine."""
    from verifiers_rl.sync.transport.gloo import create_group

    store_port = _free_port()
    world = 1 + _ok(client.get("/get_world_size"))["world_size"]  # every worker of every engine joins
    init_info = {
        "master_address": HOST,
        "master_port": store_port,
        "rank_offset": 1,
        "world_size": world,
        "bucket_bytes": bucket_bytes,
    }
    with ThreadPoolExecutor(max_workers=1) as pool:
        # The workers block inside this request until the group forms, so the trainer joins concurrently.
        fut = pool.submit(client.post, "/init_weight_transfer_engine", json={"init_info": init_info})
        pg = create_group(HOST, store_port, rank=0, world_size=world, timeout_s=60)
        _ok(fut.result(timeout=120))
        yield pg, pool
    _ok(client.post("/shutdown_weight_transfer_engine"))


def _sync(client, pg, pool, model, version: int, bucket_bytes: int) -> int:
    """One weight sync in the wire protocol our CPU engine shares; returns the number of buckets used."""
    from verifiers_rl.sync.buckets import TensorMeta, UpdateInfo, plan_buckets
    from verifiers_rl.sync.transport.gloo import send_buckets

    tensors = {name: p.detach() for name, p in model.named_parameters()}
    metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    buckets = plan_buckets(metas, bucket_bytes)
    t0 = time.monotonic()
    _ok(client.post("/start_weight_update"))
    fut = pool.submit(client.post, "/update_weights", json={"update_info": UpdateInfo.from_metas(metas).to_dict()})
    send_buckets(pg, buckets, tensors.items())  # (name, tensor) pairs in plan order
    _ok(fut.result(timeout=120))
    _ok(client.post("/finish_weight_update", json={"weight_version": str(version)}))
    _ok(client.post("/reset_prefix_cache"))
    print(f"sync v{version}: {len(metas)} tensors in {len(buckets)} buckets, {time.monotonic() - t0:.3f}s")
    assert _ok(client.get("/weight_info")) == {"weight_version": str(version)}
    return len(buckets)


def test_tensor_parallel_gloo_sync_tied_lm_head(tmp_path):
    """Two TP workers, each holding half of every layer, and a tied lm_head whose CPU reload needs a re-pack."""
    original, tokenizer = _tied_tiny_model(seed=0)
    perturbed, _ = _tied_tiny_model(seed=1)
    model_dir = tmp_path / "tied"
    original.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    tp2 = ["--tensor-parallel-size", "2"]
    with _vllm_server(str(model_dir), tmp_path / "vllm.log", tp2, {"VLLM_CPU_OMP_THREADS_BIND": _omp_bind(2)}) as srv:
        _check_chat_fields(srv)
        _check_serves(srv, original, perturbed)
        with _trainer_group(srv["client"], BUCKET_BYTES) as (pg, pool):
            assert pg.world_size == 3
            _sync(srv["client"], pg, pool, perturbed, 1, BUCKET_BYTES)
            _check_serves(srv, perturbed, original)


# ------------------------------------------------------------------ through the product launcher (vf-vllm)


def _launch(model_dir: str, out_dir: Path, *, extra=(), env=None, **kwargs):
    """vLLM started as the trainer starts it (InferenceServer -> vf-vllm -> vLLM), with our gloo backend."""
    from verifiers_rl.serving.launcher import InferenceServer

    srv = InferenceServer(
        model_dir,
        engine="vllm",
        output_dir=out_dir,
        python=VLLM_PYTHON,
        extra_args=["--weight-transfer-backend", "gloo", "--dtype", "float32", "--max-model-len", "512"]
        + ["--enforce-eager", "--max-num-seqs", "16", *extra],
        env={"VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})},
        startup_timeout=STARTUP_TIMEOUT_S,
        **kwargs,
    )
    t0 = time.monotonic()
    srv.start()
    print(f"\nvLLM ({' '.join(extra)} {kwargs}) healthy after {time.monotonic() - t0:.1f}s")
    return srv


def _forced(model, prompt_ids: list[int], ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1 : -1].double()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)


def _complete(client, model: str, prompt_ids, max_tokens=MAX_TOKENS, temperature=0.0, headers=None, **extra):
    body = {"model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": temperature}
    body.update(logprobs=0, return_token_ids=True, ignore_eos=True, seed=0, **extra)
    r = client.post("/v1/completions", json=body, headers=headers or {})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice, torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float64)


def _max_diff(client, served_name, model, prompts=PROMPTS, temperature=0.0, headers=None) -> float:
    """Worst |served - teacher-forced| logprob over `prompts`; greedy requests must also pick HF's argmax."""
    worst = 0.0
    for prompt in prompts:
        choice, got = _complete(client, served_name, prompt, temperature=temperature, headers=headers)
        ids = choice["token_ids"]
        ref = _forced(model, list(prompt), ids, temperature or 1.0)
        if not temperature:
            full = _forced_argmax(model, list(prompt), ids)
            assert ids == full, f"served {ids} but HF's argmax is {full}"
        worst = max(worst, float((got - ref).abs().max()))
    return worst


def _forced_argmax(model, prompt_ids, ids) -> list[int]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1 : -1]
    return logits.argmax(-1).tolist()


# ------------------------------------------------------------------ adapter sync into vLLM's LoRA slots

API_KEY = "sk-vf-conformance"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _set_step(peft, step: int, scale: float = 0.05) -> None:
    """Deterministic, non-zero LoRA weights per "training step" (peft's zero-init B would hide bugs)."""
    gen = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


@pytest.fixture(scope="module")
def lora(tiny_model_dir, tmp_path_factory):
    """One vLLM server in adapter mode, started as vf-rl starts it: AdapterServing flags with a zero adapter of the
    trainer's layout (`adapter.write_zero_adapter`; the trainer is another process), our worker extension, an API
    key, and the launcher's control token. The trainer-spawned path writes its real step-0 adapter with the same
    `adapter.write_served_adapter` (tests/e2e/test_trainer.py runs it on our engine)."""
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model

    from verifiers_rl.config.lora import lora_ranks
    from verifiers_rl.plan.layout import ADAPTER_NAME, AdapterServing
    from verifiers_rl.serving.client import VLLMClient
    from verifiers_rl.sync.transport.adapter import write_zero_adapter
    from verifiers_rl.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("vllm_lora")
    # rsLoRA and a per-module rank: B is pre-scaled on the trainer, so none of this reaches the server as a rule
    config = LoraConfig(r=8, lora_alpha=16, use_rslora=True, rank_pattern={"v_proj": 4}, target_modules=LORA_TARGETS)
    peft = get_peft_model(build_tiny_model(seed=0)[0], config).eval()
    _set_step(peft, 0)
    args = SimpleNamespace(lora_config=config)
    write_zero_adapter(tiny_model_dir, args, root / "adapter0")
    serving = AdapterServing(ADAPTER_NAME, str(root / "adapter0"), lora_ranks(args))
    env = {
        # Runtime LoRA routes mounted only so that the guard test can show a request with the control token gets
        # through to vLLM; adapter sync itself does not need them.
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_CPU_OMP_THREADS_BIND": _omp_bind(2),
        # vLLM's workers import the test's worker extension from tests/scripts
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT / "tests" / "scripts"), str(ROOT), os.environ.get("PYTHONPATH")])
        ),
    }
    extra = ["--api-key", API_KEY, "--worker-extension-cls", "vllm_test_extension.RefusingExtension"]
    srv = _launch(tiny_model_dir, root, adapter=serving, extra=extra, env=env, data_parallel_size=2)
    client = VLLMClient(srv.host, srv.port, control_token=srv.token, api_key=API_KEY)
    try:
        client.init_weight_transfer("adapter", bucket_bytes=4 * 1024)  # A and B of a module in different buckets
        yield {"server": srv, "client": client, "http": client._http, "peft": peft, "name": serving.name}
    finally:
        client.close()
        srv.stop()


def _stream(http, model: str, prompt_ids, max_tokens: int, got: list[int]) -> dict:
    """A streamed greedy completion; `got[0]` counts the tokens received so far, for the caller to read mid-request."""
    body = {"model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    body.update(return_token_ids=True, ignore_eos=True, seed=0)
    ids, finish = [], None
    with http.stream("POST", "/v1/completions", json=body, headers=_auth()) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: ") :])["choices"][0]
            ids += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
            got[0] = len(ids)
    return {"token_ids": ids, "finish_reason": finish}


def _auth(key: str = API_KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _adapter_diff(lora, temperature=0.0, prompts=PROMPTS, engine: int | None = None) -> float:
    # `engine`: the data-parallel engine to ask (vLLM's X-data-parallel-rank); else vLLM balances the requests
    headers = _auth() if engine is None else {**_auth(), "X-data-parallel-rank": str(engine)}
    return _max_diff(lora["http"], lora["name"], lora["peft"], prompts, temperature, headers=headers)


def test_adapter_is_served_by_name_next_to_the_base(lora, tiny_model_dir):
    from verifiers_rl.plan.serving import ReportedGpus
    from verifiers_rl.serving.session import reported_gpus
    from verifiers_rl.tiny import build_tiny_model

    models = {m["id"]: m for m in lora["client"].models()}
    assert models[lora["name"]]["parent"] == tiny_model_dir
    # the zero adapter vf-rl registers serves the base model, the step-0 policy, until the trainer's first sync
    assert _max_diff(lora["http"], lora["name"], build_tiny_model(seed=0)[0], headers=_auth()) < 1e-4
    lora["client"].update_weights(_adapter_weights(lora["peft"]), version=0)
    assert _adapter_diff(lora) < 1e-4
    # the workers say which GPUs they run on (vf_device_uuids, for the trainer's plan): none, on the CPU build;
    # vLLM answers from its first data-parallel engine only, so the other engine's worker is counted unseen
    # (issue 54 item 8)
    assert reported_gpus(lora["client"]) == ReportedGpus((), unseen=1)


def test_adapter_syncs_match_peft_and_advance_the_version(lora):
    client, peft = lora["client"], lora["peft"]
    for step in (1, 2):
        _set_step(peft, step)
        stats = client.update_weights(_adapter_weights(peft), version=step)
        print(f"adapter sync v{step}: {stats.bytes} bytes in {stats.buckets} buckets, {stats.seconds:.3f}s")
        assert client.weight_version() == str(step)
        assert stats.tensors == 2 * 7 * 2 and stats.buckets > 1
        # each sync replaces the adapter: a stacked one would serve step 1's delta plus step 2's
        assert _adapter_diff(lora) < 1e-4
    assert _adapter_diff(lora, temperature=0.7) < 1e-4  # processed logprobs


def test_base_weights_never_move(lora, tiny_model_dir):
    from verifiers_rl.tiny import build_tiny_model

    base, _ = build_tiny_model(seed=0)
    assert _max_diff(lora["http"], tiny_model_dir, base, headers=_auth()) < 1e-4
    with lora["peft"].disable_adapter():
        assert _max_diff(lora["http"], tiny_model_dir, lora["peft"], headers=_auth()) < 1e-4


def test_in_flight_request_survives_an_adapter_sync(lora):
    client, peft = lora["client"], lora["peft"]
    # Eight streamed requests of 500 tokens (they fill the 512-token context); the sync starts once one is seen
    # mid-stream. A fixed sleep raced their start, and vLLM's gauges (/metrics) lagged seconds behind the engine under
    # load, so requests could end before the gauges read running; under load some requests also start only after
    # others have ended, so the test does not wait for all eight.
    n, length = 8, 500
    got = [[0] for _ in range(n)]
    with ThreadPoolExecutor(n) as pool:
        futs = [
            pool.submit(_stream, lora["http"], lora["name"], PROMPTS[i % len(PROMPTS)], length, got[i])
            for i in range(n)
        ]
        deadline = time.monotonic() + 120

        def mid_stream() -> list[int]:
            return [i for i, g in enumerate(got) if 0 < g[0] < length]

        # Poll until one is seen mid-stream, not just until the first token: on a loaded CI machine a reader thread
        # can be starved while its request runs, then parse all 500 buffered tokens in one go (seen: two requests
        # went 0 -> 500 between polls while six had not streamed yet).
        while not mid_stream() and time.monotonic() < deadline and not all(f.done() for f in futs):
            time.sleep(0.002)
        # the sync starts mid-generation: some request has streamed tokens and has more to come. (Whether one is still
        # generating when it returns is up to the machine: under load, all finished during the sync's buckets.)
        running = mid_stream()
        assert running, (got, [f.result() for f in futs if f.done()])
        _set_step(peft, 3)
        client.update_weights(_adapter_weights(peft), version=3)
        choices = [f.result(timeout=300) for f in futs]
    assert all(c["finish_reason"] == "length" and len(c["token_ids"]) == length for c in choices)
    assert _adapter_diff(lora, prompts=PROMPTS[:1]) < 1e-4


def test_refused_adapter_updates_leave_the_adapter_serving(lora):
    import dataclasses

    from verifiers_rl.serving.client import ServerError

    client, good = lora["client"], _adapter_weights(lora["peft"])
    version = client.weight_version()  # vLLM starts at "default"
    cases = {
        "DoRA": {**good.peft_config, "use_dora": True},
        "greater than max_lora_rank": {**good.peft_config, "r": 32},
    }
    for why, config in cases.items():
        with pytest.raises(ServerError, match=why):
            client.update_weights(dataclasses.replace(good, peft_config=config), version=99)
    renamed = [(n.replace("layers.1.mlp.up_proj", "layers.7.mlp.up_proj"), t) for n, t in good.tensors]
    with pytest.raises(ServerError, match="not in the served model"):
        client.update_weights(dataclasses.replace(good, tensors=renamed), version=99)
    assert client.weight_version() == version and client.health()
    assert _adapter_diff(lora) < 1e-4  # still the last good adapter


def test_a_refusal_by_the_second_engine_fails_the_sync(lora):
    """vLLM's /collective_rpc answers with data-parallel engine 0's results only: engine 1's refusal reaches the
    trainer through the weight group's store, and fails the sync."""
    import dataclasses

    from verifiers_rl.serving.client import ServerError

    client, good = lora["client"], _adapter_weights(lora["peft"])
    refused = dataclasses.replace(good, peft_config={**good.peft_config, "vf_test_refuse_on_engine": 1})
    with pytest.raises(ServerError, match="refused on data-parallel engine 1"):
        client.update_weights(refused, version=98)
    client.update_weights(good, version=50)  # engine 0 took the refused update: one adapter on both again
    assert client.weight_version() == "50"
    assert max(_adapter_diff(lora, prompts=PROMPTS[:1], engine=e) for e in (0, 1)) < 1e-4


def test_runtime_lora_routes_need_the_control_token(lora):
    http, token = lora["http"], lora["server"].token
    body = {"lora_name": "intruder", "lora_path": "/nonexistent/adapter"}
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        denied = http.post(path, json=body, headers=_auth())  # the API key every rollout client holds
        assert denied.status_code == 401 and "X-VF-Control-Token" in denied.json()["message"]
        # with the control token the request reaches vLLM, which then judges the body itself
        passed = http.post(path, json=body, headers={**_auth(), "X-VF-Control-Token": token})
        assert passed.status_code not in (401, 403), passed.text
        assert "intruder" in passed.text
        assert http.post(path, json=body, headers={"X-VF-Control-Token": token}).status_code == 401  # vLLM's key
    assert http.post("/collective_rpc", json={"method": "vf_lora_info"}, headers=_auth()).status_code == 401
    assert _adapter_diff(lora, prompts=PROMPTS[:1]) < 1e-4


def _adapter_weights(peft):
    from verifiers_rl.sync.policy_weights import adapter_weights

    return adapter_weights(peft)
