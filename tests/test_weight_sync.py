"""Trainer -> engine weight sync: bucket math, peft name mapping, and real gloo syncs into the CPU engine."""

from __future__ import annotations

import pytest
import torch
from openai import OpenAI
from peft import LoraConfig, get_peft_model

from verifiers_rl.rl.inference.launcher import InferenceServer
from verifiers_rl.rl.inference.transfer.buckets import (
    TensorMeta,
    metas_from_update_info,
    metas_to_update_info,
    pack,
    plan_buckets,
    unpack,
)
from verifiers_rl.rl.inference.transfer.names import adapter_weights, engine_name, merged_weights
from verifiers_rl.tiny import build_tiny_model


def _metas():
    return [
        TensorMeta("a", torch.float32, (4, 4)),  # 64 B
        TensorMeta("b", torch.bfloat16, (10,)),  # 20 B
        TensorMeta("c", torch.float32, (50,)),  # 200 B
        TensorMeta("d", torch.int64, (2,)),  # 16 B
    ]


def test_plan_buckets_groups_in_order_and_isolates_big_tensors():
    buckets = plan_buckets(_metas(), bucket_bytes=100)
    assert [[m.name for m in b.metas] for b in buckets] == [["a", "b"], ["c"], ["d"]]
    assert [b.nbytes for b in buckets] == [84, 200, 16]
    assert buckets[0].offsets == (0, 64)
    assert len(plan_buckets(_metas(), bucket_bytes=10**6)) == 1
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        plan_buckets(_metas(), 0)


def test_pack_unpack_round_trip_mixed_dtypes():
    metas = _metas()
    tensors = [torch.randn(4, 4), torch.randn(10).bfloat16(), torch.randn(50), torch.tensor([3, -7])]
    for bucket in plan_buckets(metas, 100):
        idx = [metas.index(m) for m in bucket.metas]
        buf = pack(bucket, [tensors[i] for i in idx])
        for (name, t), i in zip(unpack(bucket, buf), idx):
            assert name == metas[i].name and torch.equal(t, tensors[i])


def test_pack_rejects_plan_mismatch():
    bucket = plan_buckets([TensorMeta("a", torch.float32, (2,))])[0]
    with pytest.raises(ValueError, match="its plan says"):
        pack(bucket, [torch.zeros(3)])


def test_update_info_is_vllms_format():
    info = metas_to_update_info(_metas())
    assert info == {
        "names": ["a", "b", "c", "d"],
        "dtype_names": ["float32", "bfloat16", "float32", "int64"],
        "shapes": [[4, 4], [10], [50], [2]],
    }
    assert metas_from_update_info(info) == _metas()
    with pytest.raises(ValueError, match="differ in length"):
        metas_from_update_info({"names": ["a"], "dtype_names": [], "shapes": []})


def test_engine_names():
    assert engine_name("model.layers.0.self_attn.q_proj.base_layer.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert engine_name("model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    assert engine_name("lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert engine_name("lm_head.original_module.weight") is None
    assert engine_name("model.norm.weight") == "model.norm.weight"


def _lora_model(seed=0, **cfg):
    model, tok = build_tiny_model(seed=seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], **cfg)
    peft = get_peft_model(model, config)
    torch.manual_seed(seed + 100)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # B starts at zero: give the adapter a real delta
    return peft


def test_merged_weights_equal_merge_and_unload():
    peft = _lora_model(modules_to_save=["lm_head"])
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "modules_to_save" in n:
                p.add_(0.1)
    merged = dict(merged_weights(peft))
    reference = {k: v.clone() for k, v in peft.merge_and_unload().state_dict().items()}
    assert set(merged) == set(reference)
    for k, v in reference.items():
        assert torch.allclose(merged[k], v, atol=1e-6), k


def test_merged_weights_do_not_touch_trainer_weights():
    peft = _lora_model()
    before = {n: p.clone() for n, p in peft.named_parameters()}
    list(merged_weights(peft, dtype=torch.bfloat16))
    assert all(torch.equal(before[n], p) for n, p in peft.named_parameters())


def test_adapter_weights_fold_scaling_and_are_small():
    peft = _lora_model(use_rslora=True)
    tensors = dict(adapter_weights(peft))
    layer = peft.base_model.model.model.layers[0].self_attn.q_proj
    scale = layer.scaling["default"]
    assert scale == pytest.approx(8 / 4**0.5)  # rsLoRA
    assert torch.allclose(tensors["model.layers.0.self_attn.q_proj.lora_B"], layer.lora_B["default"].weight * scale)
    full = sum(t.numel() for _, t in merged_weights(peft))
    assert sum(t.numel() for t in tensors.values()) < 0.2 * full


@pytest.fixture(scope="module")
def cpu_server(tiny_model_dir, tmp_path_factory):
    srv = InferenceServer(tiny_model_dir, engine="cpu", output_dir=tmp_path_factory.mktemp("sync"))
    client = srv.start()
    client.init_weight_transfer(bucket_bytes=32 * 1024)
    yield srv
    srv.stop()


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
    peft = _lora_model(seed=0)  # same base as the served tiny model
    peft.eval()
    version = client.version
    if mode == "merged":
        stats = client.update_weights(merged_weights(peft))
    else:
        stats = client.update_weights(adapter_weights(peft), lora_scaling=1.0)
    assert client.version == version + 1 and client.weight_version() == str(version + 1)
    prompt = list(b"reverse me")
    ids, got = _engine_logprobs(cpu_server, tiny_model_dir, prompt)
    ref = _trainer_logprobs(peft, prompt, ids)
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
    assert stats.buckets >= 1 and stats.bytes > 0


def test_adapter_sync_applies_to_pristine_base(cpu_server, tiny_model_dir):
    """Two adapter syncs in a row: the second must replace the first delta, not stack on it."""
    client = cpu_server.client
    first = _lora_model(seed=0)
    client.update_weights(adapter_weights(first), lora_scaling=1.0)
    second = _lora_model(seed=0)
    with torch.no_grad():
        for n, p in second.named_parameters():
            if "lora_B" in n:
                p.mul_(-2.0)
    client.update_weights(adapter_weights(second), lora_scaling=1.0)
    prompt = list(b"pristine")
    ids, got = _engine_logprobs(cpu_server, tiny_model_dir, prompt)
    assert torch.allclose(got, _trainer_logprobs(second.eval(), prompt, ids), atol=1e-4)


def test_bad_tensor_name_is_a_clear_error_and_server_survives(cpu_server, tiny_model_dir):
    client = cpu_server.client
    with pytest.raises(Exception, match="no parameter 'model.nope.weight'"):
        client.update_weights([("model.nope.weight", torch.zeros(4))])
    # the group and the server still work afterwards
    base, _ = build_tiny_model(seed=0)
    client.update_weights(base.named_parameters())
    prompt = list(b"alive")
    ids, got = _engine_logprobs(cpu_server, tiny_model_dir, prompt)
    assert torch.allclose(got, _trainer_logprobs(base, prompt, ids), atol=1e-4)


def test_adapter_after_merged_sync_is_refused():
    from verifiers_rl.rl.inference.engine import CPUEngine

    model, tok = build_tiny_model()
    engine = CPUEngine(model, tok, max_model_len=128, max_num_seqs=4)
    try:
        peft = _lora_model(seed=0)
        engine.load_weights(merged_weights(peft))
        with pytest.raises(ValueError, match="adapter-only sync cannot follow merged sync"):
            engine.load_weights(adapter_weights(peft), lora_scaling=1.0)
    finally:
        engine.close()
