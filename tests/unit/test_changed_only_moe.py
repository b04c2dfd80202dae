"""Issue 54 item 6: a sync of changes only is refused into vLLM for a model whose weights vLLM post-processes after
loading (a mixture of experts, a quantized checkpoint), at plan time, in one line that names the config entry.

vLLM may reorder a MoE's expert weights for its kernel once loaded (FlashInfer's CUTLASS path); changes written
through the loader's mapping would land in the loader's layout, and the check after the sync compares through the
same mapping. What the refusal stands on (which configs are caught) is tested here with transformers' own configs;
that the reordering happens is vLLM's on a GPU, which this machine does not have.
"""

from __future__ import annotations

import json

import pytest
from transformers import MixtralConfig, Qwen3Config, Qwen3MoeConfig

from verifiers_rl.errors import ConfigError
from verifiers_rl.plan.serving import plan_serving
from verifiers_rl.plan.shape import ModelShape
from verifiers_rl.scripts.rl import run_command
from verifiers_rl.trainer import RLConfig

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
TINY_MOE = Qwen3MoeConfig(vocab_size=261, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=32, **TINY)  # fmt: skip


def test_the_shape_names_the_entry_for_which_vllm_post_processes():
    # named as the config.json spells it: transformers 5 saves Qwen3-MoE's num_experts as num_local_experts;
    # Qwen3-30B-A3B's own config.json says num_experts
    assert ModelShape.from_config(TINY_MOE).post_processed == "num_local_experts=4"
    qwen3_30b = {**TINY, "vocab_size": 151936, "model_type": "qwen3_moe", "num_experts": 128}
    assert ModelShape.from_config(qwen3_30b).post_processed == "num_experts=128"
    assert ModelShape.from_config(MixtralConfig(num_local_experts=8, **TINY)).post_processed == "num_local_experts=8"
    deepseek = {**TINY, "vocab_size": 261, "n_routed_experts": 64}  # read from config.json as a dict
    assert ModelShape.from_config(deepseek).post_processed == "n_routed_experts=64"
    fp8 = {**TINY, "vocab_size": 261, "quantization_config": {"quant_method": "fp8"}}
    assert ModelShape.from_config(fp8).post_processed == "quantization_config"
    assert ModelShape.from_config({**TINY, "vocab_size": 261, "num_experts": 0}).post_processed is None
    assert ModelShape.from_config(Qwen3Config(vocab_size=261, **TINY)).post_processed is None
    vl = {**TINY, "vocab_size": 261, "text_config": {"num_experts": 128}}  # a multimodal MoE's language model
    assert ModelShape.from_config(vl).post_processed == "text_config.num_experts=128"


def _args(**kw):
    return RLConfig(
        **{"output_dir": "/tmp/unused", "use_cpu": True, "use_lora": False, "sync_changed_only": True, **kw}
    )


def test_the_serving_plan_refuses_changed_only_into_vllm_for_a_moe():
    with pytest.raises(ConfigError) as refused:
        plan_serving(_args(), mode="spawn", engine="vllm", cuda_count=2, post_processed="num_experts=4")
    line = str(refused.value)
    assert "\n" not in line and "sync_changed_only" in line and "num_experts=4" in line
    assert "set sync_changed_only = false" in line
    # a full sync of the same model is planned; our CPU engine holds transformers' layout, the trainer's own
    full = _args(sync_changed_only=False)
    assert plan_serving(full, mode="spawn", engine="vllm", cuda_count=2, post_processed="num_experts=4").sync_backend
    cpu = plan_serving(_args(server_engine="cpu"), mode="spawn", engine="cpu", cuda_count=0, post_processed="x=1")
    assert cpu.changed_only


def test_the_dry_run_refuses_it_before_anything_starts(tmp_path, capsys, monkeypatch):
    """`vf-rl --dry-run` on two (planned) GPUs with a MoE checkpoint: exit 2, one line naming the key."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    model = tmp_path / "moe"
    model.mkdir()
    TINY_MOE.to_json_file(model / "config.json")
    cfg = tmp_path / "cfg.toml"
    args = {"use_lora": False, "sync_changed_only": True, "batch_size": 8, "rollouts_per_example": 4}
    lines = [f'model = "{model}"', f'output_dir = "{tmp_path / "out"}"', "[env]", 'id = "reverse-text"']
    lines += ["[inference]", "gpus = 1", "[trainer]", "gpus = 1", "[trainer.args]"]
    cfg.write_text("\n".join(lines + [f"{k} = {json.dumps(v)}" for k, v in args.items()]) + "\n")

    assert run_command(["@", str(cfg), "--dry-run", "--gpus=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vf-rl: error: sync_changed_only") and "num_local_experts=4" in err and "\n" not in err
    # the same run with a full sync plans (the refusal is the key's, not the model's)
    assert run_command(["@", str(cfg), "--dry-run", "--gpus=2", "--trainer.args.sync_changed_only", "false"]) == 0
    assert "sparse_nccl" not in capsys.readouterr().out
