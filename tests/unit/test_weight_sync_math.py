"""Weight-sync math: bucket plans, packing, the update_info schema, peft -> engine names, merged and adapter tensors."""

from __future__ import annotations

import pytest
import torch
from peft_models import lora_model

from verifiers_rl.rl.inference.transfer.buckets import (
    TensorMeta,
    UpdateInfo,
    pack,
    plan_buckets,
    unpack,
)
from verifiers_rl.rl.inference.transfer.policy_weights import adapter_weights, engine_name, merged_weights


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
    assert UpdateInfo.from_metas(_metas(), lora_scaling=1.0).to_dict()["lora_scaling"] == 1.0
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


def test_adapter_weights_fold_scaling_and_are_small():
    peft = lora_model(use_rslora=True)
    tensors = dict(adapter_weights(peft))
    layer = peft.base_model.model.model.layers[0].self_attn.q_proj
    scale = layer.scaling["default"]
    assert scale == pytest.approx(8 / 4**0.5)  # rsLoRA
    assert torch.allclose(tensors["model.layers.0.self_attn.q_proj.lora_B"], layer.lora_B["default"].weight * scale)
    full = sum(t.numel() for _, t in merged_weights(peft))
    assert sum(t.numel() for t in tensors.values()) < 0.2 * full
