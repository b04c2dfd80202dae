"""Trainer -> engine weight sync over real gloo into the CPU engine, checked against the trainer's peft model.

Adapter sync speaks the same protocol as with vLLM (`/collective_rpc vf_lora_update`, sync/transport/adapter.py);
tests/e2e/test_vllm_gloo.py runs the same checks against the vLLM CPU build.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from openai import OpenAI
from peft_models import lora_model

from verifiers_rl.serving.client import ServerError
from verifiers_rl.serving.launcher import InferenceServer
from verifiers_rl.sync.policy_weights import adapter_weights, merged_weights
from verifiers_rl.sync.transport.adapter import lora_module
from verifiers_rl.tiny import build_tiny_model

BUCKET_BYTES = 4 * 1024  # several buckets even for the adapter: A and B of one module land in different ones


@pytest.fixture(scope="module", params=["slots", "cb"])
def cpu_server(request, tiny_model_dir, tmp_path_factory):
    # both CPU engine loops: the slot engine packs q/k/v and gate/up into shared buffers (parameters are views),
    # so a sync must write through the views for its forward to see the new weights
    srv = InferenceServer(
        tiny_model_dir,
        engine="cpu",
        output_dir=tmp_path_factory.mktemp(f"sync-{request.param}"),
        extra_args=["--cpu-engine", request.param],
    )
    srv.start()
    yield srv
    srv.stop()


def _sync(client, tensors, mode: str = "merged"):
    """One sync with the sender for `mode` (re-joining the group when the mode changes); the next version."""
    backend = "adapter" if mode == "adapter" else "gloo"
    if client.sender is None or client.sender.backend != backend:
        client.init_weight_transfer(backend, bucket_bytes=BUCKET_BYTES)
    return client.update_weights(tensors, version=int(client.weight_version()) + 1)


def _engine_logprobs(server, model_dir, prompt_ids, max_tokens=10, **extra):
    oai = OpenAI(base_url=server.base_url + "/v1", api_key="x")
    r = oai.completions.create(
        model=model_dir,
        prompt=prompt_ids,
        max_tokens=max_tokens,
        temperature=1.0,
        seed=9,
        logprobs=0,
        extra_body={"return_token_ids": True, **extra},
    )
    c = r.choices[0]
    return c.model_extra["token_ids"], torch.tensor(c.logprobs.token_logprobs)


def _trainer_logprobs(model, prompt_ids, ids):
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)


def _assert_serves(server, model_dir, model, prompt=tuple(b"reverse me")):
    prompt = list(prompt)
    ids, got = _engine_logprobs(server, model_dir, prompt)
    ref = _trainer_logprobs(model, prompt, ids)
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


def _scaled_adapter(factor: float, seed: int = 0):
    peft = lora_model(seed=seed)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.mul_(factor)
    return peft.eval()


def test_adapter_sync_matches_peft_and_advances_the_version(cpu_server, tiny_model_dir):
    client = cpu_server.client
    peft = lora_model(seed=0).eval()  # same base as the served tiny model
    version = int(client.weight_version())
    stats = _sync(client, adapter_weights(peft), "adapter")
    assert stats.version == version + 1 and client.weight_version() == str(version + 1)
    assert client.get("/health")["policy_version"] == version + 1
    assert stats.buckets > 1 and stats.tensors == 12 and stats.bytes > 0
    _assert_serves(cpu_server, tiny_model_dir, peft)


def test_adapter_syncs_replace_rather_than_stack_and_keep_the_base(cpu_server, tiny_model_dir):
    client = cpu_server.client
    for factor in (1.0, -2.0, 0.5):  # each sync applies its own delta to the pristine base
        peft = _scaled_adapter(factor)
        _sync(client, adapter_weights(peft), "adapter")
        _assert_serves(cpu_server, tiny_model_dir, peft)
    # a zero adapter gives back the base model exactly as loaded
    _sync(client, adapter_weights(_scaled_adapter(0.0)), "adapter")
    _assert_serves(cpu_server, tiny_model_dir, build_tiny_model(seed=0)[0])


def test_refused_adapter_update_leaves_the_served_weights(cpu_server, tiny_model_dir):
    client = cpu_server.client
    peft = _scaled_adapter(1.5)
    _sync(client, adapter_weights(peft), "adapter")
    good = adapter_weights(peft)
    dora = dataclasses.replace(good, peft_config={**good.peft_config, "use_dora": True})
    unscaled = dataclasses.replace(good, peft_config={**good.peft_config, "lora_alpha": 16})
    renamed = dataclasses.replace(good, tensors=[(n.replace("q_proj", "nope_proj"), t) for n, t in good.tensors])
    for bad, why in ((dora, "DoRA"), (unscaled, "pre-multiplied"), (renamed, "no parameter .*nope_proj")):
        with pytest.raises(ServerError, match=why):
            _sync(client, bad, "adapter")
        _assert_serves(cpu_server, tiny_model_dir, peft)  # the group and the weights survive


def test_in_flight_request_survives_an_adapter_sync(cpu_server, tiny_model_dir):
    client = cpu_server.client
    out = {}
    worker = threading.Thread(
        target=lambda: out.update(
            r=_engine_logprobs(cpu_server, tiny_model_dir, [1, 2], max_tokens=200, ignore_eos=True)
        )
    )
    worker.start()
    peft = _scaled_adapter(-1.0)
    _sync(client, adapter_weights(peft), "adapter")
    worker.join(120)
    assert len(out["r"][0]) == 200
    _assert_serves(cpu_server, tiny_model_dir, peft)


def test_merged_sync_matches_lora_policy(cpu_server, tiny_model_dir):
    """After the adapter tests: a merged sync overwrites the base the adapter tests kept pristine."""
    client = cpu_server.client
    peft = lora_model(seed=0).eval()
    version = int(client.weight_version())
    stats = _sync(client, merged_weights(peft), "merged")
    assert stats.version == version + 1 and client.weight_version() == str(version + 1)
    _assert_serves(cpu_server, tiny_model_dir, peft)


def test_bad_tensor_name_is_a_clear_error_and_server_survives(cpu_server, tiny_model_dir):
    client = cpu_server.client
    with pytest.raises(Exception, match="no parameter 'model.nope.weight'"):
        _sync(client, [("model.nope.weight", torch.zeros(4))])
    # the group and the server still work afterwards
    base, _ = build_tiny_model(seed=0)
    _sync(client, base.named_parameters())
    _assert_serves(cpu_server, tiny_model_dir, base, list(b"alive"))


def _engine_names(weights):
    """What the CPU server's vf_lora_update hands the engine: `<module>.lora_A` / `<module>.lora_B`."""
    return [(".".join(lora_module(n)), t) for n, t in weights]


@pytest.fixture(params=["slots", "cb"])
def engine_cls(request):
    from verifiers_rl.inference.cpu.cb_engine import CPUEngine
    from verifiers_rl.inference.cpu.slot_engine import SlotEngine

    return SlotEngine if request.param == "slots" else CPUEngine


def test_engine_keeps_the_pristine_base_bit_exact(engine_cls):
    model, tok = build_tiny_model()
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = engine_cls(model, tok, max_model_len=128, max_num_seqs=4)
    try:
        for factor in (1.0, 3.0, 0.0):
            engine.load_weights(_engine_names(adapter_weights(_scaled_adapter(factor))), lora_scaling=1.0)
        # after a zero adapter every weight is bit-identical to the base: the deltas never accumulate
        assert all(torch.equal(p, base[n]) for n, p in engine.model.named_parameters())
    finally:
        engine.close()


def test_adapter_after_merged_sync_is_refused(engine_cls):
    model, tok = build_tiny_model()
    engine = engine_cls(model, tok, max_model_len=128, max_num_seqs=4)
    try:
        peft = lora_model(seed=0)
        engine.load_weights(merged_weights(peft))
        with pytest.raises(ValueError, match="adapter-only sync cannot follow merged sync"):
            engine.load_weights(_engine_names(adapter_weights(peft)), lora_scaling=1.0)
    finally:
        engine.close()


def test_every_receiving_rank_reports_through_the_store():
    """The trainer learns each rank's answer to an adapter update from its own store (vLLM's /collective_rpc
    under data parallelism answers with the first engine's results only); a rank with no answer is named."""
    import datetime

    import torch.distributed as dist

    from verifiers_rl.sync.transport import gloo

    store = gloo.open_store("127.0.0.1", 0, world_size=3, timeout_s=10)  # closes its own listening descriptor
    peer = dist.TCPStore("127.0.0.1", store.port, 3, is_master=False, timeout=datetime.timedelta(seconds=10))
    trainer = gloo.WeightGroup(None, store, rank=0, world_size=3, key="run")
    gloo.publish_report(gloo.WeightGroup(None, peer, rank=1, world_size=3, key="run"), "7-a", {"tensors": 4})
    with pytest.raises(RuntimeError, match=r"inference ranks \[2\] left no answer"):
        gloo.collect_reports(trainer, "7-a", timeout_s=0.5)
    gloo.publish_report(gloo.WeightGroup(None, peer, rank=2, world_size=3, key="run"), "7-a", {"error": "no"})
    assert gloo.collect_reports(trainer, "7-a", timeout_s=5) == {1: {"tensors": 4}, 2: {"error": "no"}}
    with pytest.raises(RuntimeError, match=r"ranks \[1, 2\]"):  # read once: the next sync starts clean
        gloo.collect_reports(trainer, "7-a", timeout_s=0.2)
