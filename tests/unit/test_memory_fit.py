"""fit_training: the memory planner fits a run (activation checkpointing, a token budget) instead of refusing it,
and refuses only when nothing fits, naming settings that are not already so."""

from __future__ import annotations

import re

import pytest

from verifiers_rl.errors import ConfigError
from verifiers_rl.plan.memory import GIB, chunk_rows, fit_training, shape_of


def _fit(model: str, gpu_gib: float, **kw):
    args = {"layout": "ddp", "ranks": 1, "use_lora": True, "lora_rank": 8, "micro_batch_size": 8,
            "max_seq_len": 2048, "micro_batch_tokens": None, "activation_checkpointing": None,
            "shared_with_server": False}  # fmt: skip
    return fit_training(shape_of(model), int(gpu_gib * GIB), **{**args, **kw})


def test_upstream_math_python_plans_with_checkpointing():
    """verifiers' configs/vf-rl/math-python.toml: Qwen3-4B, 2 trainer GPUs (DDP), LoRA, 8 x 4096 tokens."""
    fit = _fit("Qwen/Qwen3-4B-Instruct-2507", 80, ranks=2, micro_batch_size=8, max_seq_len=4096)
    assert fit.measures == {"activation_checkpointing": True}
    assert fit.parts["total"] <= 80 * GIB and fit.gpu_memory_utilization is None
    text = "\n".join(fit.describe())
    assert "activation_checkpointing = true" in text and "each of 2 trainer rank(s)" in text


def test_a_token_budget_is_chosen_when_checkpointing_is_off_by_choice():
    fit = _fit("Qwen/Qwen3-4B", 80, ranks=2, max_seq_len=4096, activation_checkpointing=False)
    tokens = fit.measures["micro_batch_tokens"]
    assert list(fit.measures) == ["micro_batch_tokens"] and 4096 <= tokens < 8 * 4096
    assert fit.parts["total"] <= 80 * GIB


def test_a_token_budget_is_the_largest_that_fits():
    fit = _fit("Qwen/Qwen3-4B", 80, ranks=2, max_seq_len=4096, activation_checkpointing=False)
    tokens = fit.measures["micro_batch_tokens"]
    with pytest.raises(ConfigError):  # one step more no longer fits: the user's budget is kept and refused
        _fit("Qwen/Qwen3-4B", 80, ranks=2, max_seq_len=4096, activation_checkpointing=False,
             micro_batch_tokens=tokens + 256)  # fmt: skip
    assert "micro_batch_tokens = " in fit.reasons[0]
    # both measures when checkpointing alone is not enough (8B, 16 x 8192 tokens a micro-batch)
    both = _fit("Qwen/Qwen3-8B", 80, ranks=2, micro_batch_size=16, max_seq_len=8192)
    assert both.measures["activation_checkpointing"] is True and 8192 <= both.measures["micro_batch_tokens"] < 131072
    assert len(both.reasons) == 2


def test_refusal_names_only_settings_that_would_change():
    with pytest.raises(ConfigError) as e:
        _fit("Qwen/Qwen3-8B", 16, use_lora=True, activation_checkpointing=True, max_seq_len=2048)
    msg = str(e.value)
    assert "\n" not in msg and "its GPU has 16.0 GiB" in msg
    assert "use_lora" not in msg and "activation_checkpointing" not in msg  # both already on
    assert "shard the model" in msg and "max_seq_len (now 2048)" in msg
    with pytest.raises(ConfigError) as e:
        _fit("Qwen/Qwen3-8B", 24, use_lora=False, activation_checkpointing=False, micro_batch_tokens=8192,
             layout="zero3", ranks=2)  # fmt: skip
    msg = str(e.value)
    assert "use_lora = true" in msg and "activation_checkpointing = true" in msg
    assert "micro_batch_tokens (now 8192)" in msg and "more trainer GPUs" in msg and "shard the model" not in msg


@pytest.mark.parametrize("gpu_gib", [24, 80])
def test_one_gpu_shared_plan_for_reverse_text(gpu_gib):
    """reverse-text-like: Qwen3-0.6B, LoRA, one GPU for vLLM and the trainer."""
    fit = _fit("Qwen/Qwen3-0.6B", gpu_gib, shared_with_server=True, max_seq_len=2048)
    util = fit.gpu_memory_utilization
    assert 0 < util < 1 and fit.vllm["kv_tokens"] >= 2048
    assert util * gpu_gib * GIB + fit.parts["total"] < gpu_gib * GIB  # both fit
    assert f"--gpu-memory-utilization {util:.2f}" in "\n".join(fit.describe())
    assert (fit.measures == {"activation_checkpointing": True}) == (gpu_gib == 24)


def test_a_written_gpu_memory_utilization_is_kept_or_refused_with_both_numbers():
    kept = _fit("Qwen/Qwen3-0.6B", 24, shared_with_server=True, gpu_memory_utilization=0.8)
    assert kept.gpu_memory_utilization == 0.8 and kept.parts["total"] <= 0.2 * 24 * GIB
    with pytest.raises(ConfigError) as e:
        _fit("Qwen/Qwen3-0.6B", 24, shared_with_server=True, gpu_memory_utilization=0.95)
    msg = str(e.value)
    trainer = re.search(r"needs ~([\d.]+) GiB", msg)
    assert "gpu_memory_utilization = 0.95 (22.8 GiB)" in msg and trainer and float(trainer.group(1)) > 1.2
    with pytest.raises(ConfigError, match="less than its weights"):  # too little for vLLM itself
        _fit("Qwen/Qwen3-0.6B", 24, shared_with_server=True, gpu_memory_utilization=0.05)


def test_chunk_rows_follow_the_trainers_logprobs():
    from verifiers_rl.loss.logprobs import auto_chunk_size

    for vocab in (261, 512, 32000, 151936, 262144):
        assert chunk_rows(vocab) == auto_chunk_size(vocab)
