"""Conformance against real vLLM (the CPU build): our `gloo` weight-transfer plugin and the RL HTTP routes.

Skipped unless VF_VLLM_PYTHON names the python of a venv with vLLM >= 0.32 and this package installed
(`pip install --no-deps -e .` there registers the plugin's entry point). The trainer side runs here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

VLLM_PYTHON = os.environ.get("VF_VLLM_PYTHON", "")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not (VLLM_PYTHON and os.access(VLLM_PYTHON, os.X_OK)),
        reason="set VF_VLLM_PYTHON to the python of a venv with vLLM >= 0.32",
    ),
]

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 240
# Small enough that the tiny model spans many buckets and q/k/v of one layer land in different ones.
BUCKET_BYTES = 12 * 1024
PROMPT = [{"role": "user", "content": "Count: one two three"}]
MAX_TOKENS = 12


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


@contextlib.contextmanager
def _vllm_server(model_dir: str, log_path: Path):
    """Start real vLLM with the gloo backend on a free loopback port; always kill its process group."""
    import httpx

    from verifiers_rl.rl.inference.vllm_command import build_vllm_command

    port = _free_port()
    argv, env_add = build_vllm_command(
        model_dir,
        HOST,
        port,
        extra_args=["--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--max-num-seqs", "16"],
        weight_backend="gloo",
        python=VLLM_PYTHON,
    )
    env = {**os.environ, **env_add, "VLLM_CPU_KVCACHE_SPACE": "1"}
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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from verifiers_rl.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("vllm_gloo")
    with _vllm_server(str(save_tiny_model(root / "model")), root / "vllm.log") as srv:
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


def _chat(server, temperature: float):
    return _ok(
        server["client"].post(
            "/v1/chat/completions",
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
        "from verifiers_rl.rl.inference.vllm_command import check_vllm\n"
        "print(cls.__name__, check_vllm())\n"
    )
    out = subprocess.run([VLLM_PYTHON, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    name, version = out.stdout.split()[-2:]
    assert name == "GlooWeightTransferEngine"
    assert tuple(int(x) for x in version.split("+")[0].split(".")[:2]) >= (0, 32)


def test_chat_returns_token_ids_and_logprobs(server):
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


def _check_serves(server, model, other):
    """Greedy tokens equal HF's for `model`, logprobs match its teacher-forced ones, and not `other`'s."""
    body = _chat(server, temperature=0.0)
    prompt_ids, tokens = body["prompt_token_ids"], body["choices"][0]["token_ids"]
    served = [c["logprob"] for c in body["choices"][0]["logprobs"]["content"]]
    greedy, forced = _hf_reference(model, prompt_ids, tokens)
    assert tokens == greedy
    assert max(abs(a - b) for a, b in zip(served, forced)) < 1e-4
    # The comparison must be able to tell the two weight sets apart.
    _, forced_other = _hf_reference(other, prompt_ids, tokens)
    assert max(abs(a - b) for a, b in zip(served, forced_other)) > 1e-2


@contextlib.contextmanager
def _trainer_group(client, bucket_bytes: int):
    """Rank 0 of the gloo group, formed concurrently with the server's /init_weight_transfer_engine."""
    from verifiers_rl.rl.inference.transfer.gloo import create_group

    store_port = _free_port()
    init_info = {
        "master_address": HOST,
        "master_port": store_port,
        "rank_offset": 1,
        "world_size": 2,
        "bucket_bytes": bucket_bytes,
    }
    with ThreadPoolExecutor(max_workers=1) as pool:
        # The worker blocks inside this request until the group forms, so the trainer joins concurrently.
        fut = pool.submit(client.post, "/init_weight_transfer_engine", json={"init_info": init_info})
        pg = create_group(HOST, store_port, rank=0, world_size=2, timeout_s=60)
        _ok(fut.result(timeout=120))
        yield pg, pool
    _ok(client.post("/shutdown_weight_transfer_engine"))


def _sync(client, pg, pool, model, version: int, bucket_bytes: int) -> int:
    """One weight sync in the wire protocol our CPU engine shares; returns the number of buckets used."""
    from verifiers_rl.rl.inference.transfer.buckets import TensorMeta, metas_to_update_info, plan_buckets
    from verifiers_rl.rl.inference.transfer.gloo import send_buckets

    tensors = {name: p.detach() for name, p in model.named_parameters()}
    metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    buckets = plan_buckets(metas, bucket_bytes)
    t0 = time.monotonic()
    _ok(client.post("/start_weight_update"))
    fut = pool.submit(client.post, "/update_weights", json={"update_info": metas_to_update_info(metas)})
    send_buckets(pg, buckets, tensors)
    _ok(fut.result(timeout=120))
    _ok(client.post("/finish_weight_update", json={"weight_version": str(version)}))
    _ok(client.post("/reset_prefix_cache"))
    print(f"sync v{version}: {len(metas)} tensors in {len(buckets)} buckets, {time.monotonic() - t0:.3f}s")
    assert _ok(client.get("/weight_info")) == {"weight_version": str(version)}
    return len(buckets)


def test_gloo_sync_matches_hf(server):
    from verifiers_rl.tiny import build_tiny_model

    client = server["client"]
    original, _ = build_tiny_model(seed=0)
    perturbed, _ = build_tiny_model(seed=1)
    _check_serves(server, original, perturbed)
    with _trainer_group(client, BUCKET_BYTES) as (pg, pool):
        # Forth and back: a second sync proves the reload lifecycle can repeat.
        for version, model, other in ((1, perturbed, original), (2, original, perturbed)):
            assert _sync(client, pg, pool, model, version, BUCKET_BYTES) >= 8
            _check_serves(server, model, other)


def test_gloo_sync_tied_lm_head(tmp_path):
    # Own short-lived server: the tied layout needs its own checkpoint.
    original, tokenizer = _tied_tiny_model(seed=0)
    perturbed, _ = _tied_tiny_model(seed=1)
    model_dir = tmp_path / "tied"
    original.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    with _vllm_server(str(model_dir), tmp_path / "vllm.log") as srv:
        _check_serves(srv, original, perturbed)
        with _trainer_group(srv["client"], BUCKET_BYTES) as (pg, pool):
            _sync(srv["client"], pg, pool, perturbed, 1, BUCKET_BYTES)
            _check_serves(srv, perturbed, original)
