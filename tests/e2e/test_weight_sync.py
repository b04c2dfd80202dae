"""Trainer -> engine weight sync over real gloo into the CPU engine, checked against the trainer's peft model."""

from __future__ import annotations

import pytest
import torch
from openai import OpenAI
from peft_models import lora_model

from verifiers_rl.rl.inference.launcher import InferenceServer
from verifiers_rl.rl.inference.transfer.policy_weights import adapter_weights, merged_weights
from verifiers_rl.tiny import build_tiny_model


@pytest.fixture(scope="module")
def cpu_server(tiny_model_dir, tmp_path_factory):
    srv = InferenceServer(tiny_model_dir, engine="cpu", output_dir=tmp_path_factory.mktemp("sync"))
    client = srv.start()
    client.init_weight_transfer(bucket_bytes=32 * 1024)
    yield srv
    srv.stop()


def _sync(client, tensors, mode: str = "merged"):
    """One sync with the sender for `mode` (re-joining the group when the mode changes); the next version."""
    backend = "adapter" if mode == "adapter" else "gloo"
    if client.sender is None or client.sender.backend != backend:
        client.init_weight_transfer(backend, bucket_bytes=32 * 1024)
    return client.update_weights(tensors, version=int(client.weight_version()) + 1)


def _engine_logprobs(server, model_dir, prompt_ids):
    oai = OpenAI(base_url=server.base_url + "/v1", api_key="x")
    r = oai.completions.create(
        model=model_dir,
        prompt=prompt_ids,
        max_tokens=10,
        temperature=1.0,
        seed=9,
        logprobs=0,
        extra_body={"return_token_ids": True},
    )
    c = r.choices[0]
    return c.model_extra["token_ids"], torch.tensor(c.logprobs.token_logprobs)


def _trainer_logprobs(model, prompt_ids, ids):
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1 : -1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)


@pytest.mark.parametrize("mode", ["adapter", "merged"])  # adapter first: it records the pristine base
def test_sync_makes_engine_match_lora_policy(cpu_server, tiny_model_dir, mode):
    client = cpu_server.client
    peft = lora_model(seed=0)  # same base as the served tiny model
    peft.eval()
    version = int(client.weight_version())
    stats = _sync(client, merged_weights(peft) if mode == "merged" else adapter_weights(peft), mode)
    assert stats.version == version + 1 and client.weight_version() == str(version + 1)
    prompt = list(b"reverse me")
    ids, got = _engine_logprobs(cpu_server, tiny_model_dir, prompt)
    ref = _trainer_logprobs(peft, prompt, ids)
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
    assert stats.buckets >= 1 and stats.bytes > 0


def test_adapter_sync_applies_to_pristine_base(cpu_server, tiny_model_dir):
    """Two adapter syncs in a row: the second must replace the first delta, not stack on it."""
    client = cpu_server.client
    first = lora_model(seed=0)
    _sync(client, adapter_weights(first), "adapter")
    second = lora_model(seed=0)
    with torch.no_grad():
        for n, p in second.named_parameters():
            if "lora_B" in n:
                p.mul_(-2.0)
    _sync(client, adapter_weights(second), "adapter")
    prompt = list(b"pristine")
    ids, got = _engine_logprobs(cpu_server, tiny_model_dir, prompt)
    assert torch.allclose(got, _trainer_logprobs(second.eval(), prompt, ids), atol=1e-4)


def test_bad_tensor_name_is_a_clear_error_and_server_survives(cpu_server, tiny_model_dir):
    client = cpu_server.client
    with pytest.raises(Exception, match="no parameter 'model.nope.weight'"):
        _sync(client, [("model.nope.weight", torch.zeros(4))])
    # the group and the server still work afterwards
    base, _ = build_tiny_model(seed=0)
    _sync(client, base.named_parameters())
    prompt = list(b"alive")
    ids, got = _engine_logprobs(cpu_server, tiny_model_dir, prompt)
    assert torch.allclose(got, _trainer_logprobs(base, prompt, ids), atol=1e-4)


def test_adapter_after_merged_sync_is_refused():
    from verifiers_rl.rl.inference.engine import CPUEngine

    model, tok = build_tiny_model()
    engine = CPUEngine(model, tok, max_model_len=128, max_num_seqs=4)
    try:
        peft = lora_model(seed=0)
        engine.load_weights(merged_weights(peft))
        with pytest.raises(ValueError, match="adapter-only sync cannot follow merged sync"):
            engine.load_weights(adapter_weights(peft), lora_scaling=1.0)
    finally:
        engine.close()
