"""Weight-sync math: bucket plans, packing, the update_info schema, peft -> engine names, merged and adapter tensors."""

from __future__ import annotations

import json

import pytest
import torch
from peft_models import lora_model

from verifiers_rl.sync.buckets import (
    TensorMeta,
    UpdateInfo,
    pack,
    plan_buckets,
    unpack,
)
from verifiers_rl.sync.policy_weights import adapter_weights, engine_name, merged_weights
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
    info = UpdateInfo.from_metas(_metas()).to_dict()
    assert info == {
        "names": ["a", "b", "c", "d"],
        "dtype_names": ["float32", "bfloat16", "float32", "int64"],
        "shapes": [[4, 4], [10], [50], [2]],
    }
    assert UpdateInfo.parse(info).metas() == _metas()
    with pytest.raises(ValueError, match="unknown keys"):  # adapter sync has its own RPC now
        UpdateInfo.parse({**info, "lora_scaling": 1.0})
    with pytest.raises(ValueError, match="differ in length"):
        UpdateInfo.parse({"names": ["a"], "dtype_names": [], "shapes": []})
    with pytest.raises(ValueError, match="unknown keys"):
        UpdateInfo.parse({**info, "colour": "red"})
    with pytest.raises(ValueError, match="unknown dtype"):
        UpdateInfo.parse({**info, "dtype_names": ["float32", "bfloat16", "float32", "nope"]}).metas()


def test_engine_names():
    assert engine_name("model.layers.0.self_attn.q_proj.base_layer.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert engine_name("model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    assert engine_name("lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert engine_name("lm_head.original_module.weight") is None
    assert engine_name("model.norm.weight") == "model.norm.weight"


def test_merged_weights_equal_merge_and_unload():
    peft = lora_model(modules_to_save=["lm_head"])
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
    peft = lora_model()
    before = {n: p.clone() for n, p in peft.named_parameters()}
    list(merged_weights(peft, dtype=torch.bfloat16))
    assert all(torch.equal(before[n], p) for n, p in peft.named_parameters())


def test_an_abandoned_merged_weight_iterator_leaves_grad_mode_on():
    """A sync that fails part-way abandons the iterator; grad mode in the trainer's thread must not stay off
    (test_trainer failed after test_weight_sync in one session: a suspended generator held torch.no_grad())."""
    weights = merged_weights(lora_model())
    next(weights)
    assert torch.is_grad_enabled()
    assert not any(t.requires_grad for _, t in weights)


def test_adapter_weights_are_peft_names_with_prescaled_b_and_small():
    from peft import get_peft_model_state_dict

    peft = lora_model(use_rslora=True)
    weights = adapter_weights(peft)
    tensors = dict(weights)
    assert list(tensors) == list(get_peft_model_state_dict(peft))  # vLLM reads peft's own names
    layer = peft.base_model.model.model.layers[0].self_attn.q_proj
    scale = layer.scaling["default"]
    assert scale == pytest.approx(8 / 4**0.5)  # rsLoRA
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    assert torch.equal(tensors[f"{prefix}.lora_A.weight"], layer.lora_A["default"].weight)
    assert torch.allclose(tensors[f"{prefix}.lora_B.weight"], layer.lora_B["default"].weight * scale)
    # the config says "already scaled", whatever peft's alpha and rsLoRA were
    cfg = weights.peft_config
    assert (cfg["r"], cfg["lora_alpha"], cfg["use_rslora"], cfg["rank_pattern"]) == (4, 4, False, {})
    assert cfg["target_modules"] == ["down_proj", "q_proj", "v_proj"] and weights.rank == 4
    full = sum(t.numel() for _, t in merged_weights(peft))
    assert sum(t.numel() for t in tensors.values()) < 0.2 * full


def test_adapter_weights_applied_as_w0_plus_ba_give_the_peft_model():
    """What every receiver does with the tensors (W0 + B @ A, no scaling rule) reproduces peft's forward."""
    from verifiers_rl.sync.transport.adapter import lora_module

    peft = lora_model(rank_pattern={"v_proj": 2}, alpha_pattern={"down_proj": 3})
    weights = adapter_weights(peft)
    assert weights.peft_config["rank_pattern"] == weights.peft_config["alpha_pattern"]
    assert set(weights.peft_config["rank_pattern"].values()) == {2} and weights.rank == 4
    base, _ = build_tiny_model(seed=0)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        module, kind = lora_module(name)
        pairs.setdefault(module, {})[kind] = t
    params = dict(base.named_parameters())
    with torch.no_grad():
        for module, ab in pairs.items():
            params[f"{module}.weight"].add_(ab["lora_B"] @ ab["lora_A"])
        ids = torch.tensor([list(b"adapter math")])
        assert torch.allclose(base(ids).logits, peft(ids).logits, atol=1e-5)


@pytest.mark.parametrize(
    "cfg, match",
    [
        (dict(use_dora=True), "DoRA"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(bias="lora_only"), "trained biases"),
    ],
)
def test_adapter_weights_refuse_what_lora_slots_cannot_hold(cfg, match):
    with pytest.raises(ValueError, match=match):
        adapter_weights(lora_model(**cfg))


def test_adapter_weights_refuse_embedding_lora_and_full_models():
    model, _ = build_tiny_model()
    with pytest.raises(ValueError, match="needs a peft LoRA model"):
        adapter_weights(model)
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(build_tiny_model()[0], LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
    with pytest.raises(ValueError, match="linear layers only"):
        adapter_weights(peft)


def test_adapter_update_round_trip_and_errors():
    from verifiers_rl.sync.transport.adapter import AdapterUpdate, lora_module

    update = AdapterUpdate(UpdateInfo.from_metas(_metas()), {"r": 8, "lora_alpha": 8})
    back = AdapterUpdate.parse(update.to_json())
    assert back == update and back.lora_int_id == 1 and back.report == ""
    info = UpdateInfo.from_metas(_metas())
    info.report = "7-abc"
    reported = AdapterUpdate(info, {"r": 8})
    assert "report" not in json.loads(reported.to_json())  # it travels inside update_info, like a full sync's
    assert AdapterUpdate.parse(reported.to_json()).report == "7-abc"
    # what earlier senders wrote: the id beside update_info
    legacy = {**json.loads(update.to_json()), "report": "7-abc"}
    assert AdapterUpdate.parse(json.dumps(legacy)).report == "7-abc"
    with pytest.raises(ValueError, match="not JSON"):
        AdapterUpdate.parse("{")
    with pytest.raises(ValueError, match="expected keys"):
        AdapterUpdate.parse('{"update_info": {}}')
    assert lora_module("base_model.model.model.layers.1.mlp.up_proj.lora_B.weight") == (
        "model.layers.1.mlp.up_proj",
        "lora_B",
    )
    for bad in ("model.layers.1.mlp.up_proj.lora_B.weight", "base_model.model.lm_head.weight"):
        with pytest.raises(ValueError):
            lora_module(bad)


def test_write_adapter_is_a_peft_adapter_directory(tmp_path):
    import json

    from safetensors.torch import load_file

    from verifiers_rl.sync.transport.adapter import adapter_serving

    peft = lora_model()
    serving = adapter_serving(peft, tmp_path / "step0")
    assert (serving.name, serving.rank) == ("policy", 4)
    saved = load_file(str(tmp_path / "step0" / "adapter_model.safetensors"))
    weights = adapter_weights(peft)
    assert set(saved) == {n for n, _ in weights} and all(torch.equal(saved[n], t) for n, t in weights)
    assert json.loads((tmp_path / "step0" / "adapter_config.json").read_text()) == weights.peft_config
