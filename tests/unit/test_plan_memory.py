"""One GPU for server and trainer: the memory planner against peaks measured on an H100, and the layout rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verifiers_rl.errors import ConfigError
from verifiers_rl.plan.devices import assign_gpus
from verifiers_rl.plan.memory import FLOAT32, GIB, LORA_TARGETS, ModelShape, fit_training, rank_parts, shape_of
from verifiers_rl.plan.serving import resolve_sync_backend

MEASURED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "shared_gpu_memory.json"


def test_trainer_estimate_covers_measured_peaks_without_wasting_the_gpu():
    """benchmarks/shared_gpu_memory.py on an H100: Qwen3-0.6B shape, bf16, LoRA r16 and full fine-tuning.

    The committed rows ran the step without autocast (the benchmark now runs it under autocast and says so in
    each row). Under bf16 = true the trainer's forward runs under accelerate's autocast, which changes one thing
    the planner counts: LoRA's adapters keep their inputs in bf16, not in peft's float32 copy
    (tests/unit/test_memory_measured.py measures the step as the trainer runs it). So a LoRA row measured without
    autocast is held against the estimate plus those copies' extra two bytes, counted here from the shape."""
    shape = shape_of("Qwen/Qwen3-0.6B")
    rows = json.loads(MEASURED.read_text())["trainer"]
    assert len(rows) >= 5 and any(r["use_lora"] for r in rows)
    q = shape.heads * shape.head_dim
    adapter_inputs = 3 * shape.hidden + q + 2 * shape.hidden + shape.intermediate + LORA_TARGETS * 16
    for r in rows:
        parts = rank_parts(  # one process on its own GPU: a single DDP rank
            shape,
            layout="ddp",
            ranks=1,
            use_lora=r["use_lora"],
            lora_rank=16,
            micro_batch_tokens=r["tokens"],
            max_seq_len=1024,  # the benchmark's rows: 1024 tokens each
            activation_checkpointing=r["checkpointing"],
            master_bytes=2,  # what these rows measured: bf16 weights and AdamW state (before float32 master weights)
        )
        est = parts["total"] - parts["cuda_context"]  # torch.cuda.max_memory_allocated does not see the context
        if r["use_lora"] and not r.get("autocast"):  # float32 adapter inputs: every layer's, or the recomputed one
            est += (FLOAT32 - 2) * adapter_inputs * r["tokens"] * (1 if r["checkpointing"] else shape.layers)
        ratio = est / GIB / r["peak_gib"]
        assert 1.0 <= ratio <= 1.25, (r, ratio)  # never below the peak, at most a quarter above


def test_shape_from_config_counts_parameters_like_the_model():
    from verifiers_rl.tiny import build_tiny_model

    model, _ = build_tiny_model(hidden=128, layers=3)
    assert ModelShape.from_config(model.config).params == sum(p.numel() for p in model.parameters())
    assert shape_of("Qwen/Qwen3-4B-Instruct-2507").layers == 36  # known shapes match name variants
    assert shape_of("no/such-model") is None


def _shared(shape, gpu_bytes, **kw):
    """The planner for one trainer process on the GPU it shares with vLLM, with the run's settings as written."""
    return fit_training(shape, gpu_bytes, layout="ddp", ranks=1, micro_batch_size=1, shared_with_server=True, **kw)


def test_plan_gives_vllm_what_the_trainer_leaves():
    shape = shape_of("Qwen/Qwen3-0.6B")
    kw = dict(use_lora=True, lora_rank=16, max_seq_len=2048, activation_checkpointing=False)
    small = _shared(shape, 80 * GIB, micro_batch_tokens=4096, **kw)
    big = _shared(shape, 80 * GIB, micro_batch_tokens=16384, **kw)
    assert small.measures == {} and big.measures == {}  # both fit as configured: nothing changed
    assert 0 < big.gpu_memory_utilization < small.gpu_memory_utilization < 1
    for plan in (small, big):
        vllm = plan.gpu_memory_utilization * plan.gpu_bytes
        assert vllm + plan.parts["total"] < plan.gpu_bytes  # both fit
        assert plan.vllm["kv_tokens"] >= 2048  # at least one full sequence
    assert "--gpu-memory-utilization" in "\n".join(small.describe())


def test_plan_that_does_not_fit_says_what_to_change():
    shape = shape_of("Qwen/Qwen3-8B")
    with pytest.raises(ConfigError) as refused:
        _shared(shape, 24 * GIB, use_lora=False, lora_rank=8, micro_batch_tokens=16384, max_seq_len=4096,
                activation_checkpointing=False)  # fmt: skip
    why = str(refused.value)
    assert why.startswith("one trainer rank needs ~") and "the 24.0 GiB GPU it shares with vLLM" in why
    for change in ("LoRA (use_lora = true)", "activation_checkpointing = true", "a smaller micro_batch_tokens",
                   "a second GPU, so that the server has one of its own"):  # fmt: skip
        assert change in why, (change, why)


def test_one_visible_gpu_is_shared_not_refused():
    one = assign_gpus(1, 1, 1)
    assert one.shared and one.inference == [0] and one.trainer == [0]
    explicit = assign_gpus(2, 0, 2)
    assert explicit.shared and explicit.inference == [0] and explicit.trainer == [0, 1]
    two = assign_gpus(2, 1, 1)
    assert not two.shared and two.inference == [0] and two.trainer == [1]


def test_shared_gpu_syncs_through_host_memory():
    assert resolve_sync_backend("auto", "vllm", shared_gpu=True) == "gloo"
    assert resolve_sync_backend("auto", "vllm") == "nccl"
    with pytest.raises(ValueError, match="cannot sync a server on the trainer's own GPU"):
        resolve_sync_backend("nccl", "vllm", shared_gpu=True)


def test_full_finetuning_counts_float32_master_weights():
    """Full fine-tuning trains float32 master weights under bf16 compute: weight 4 bytes, gradient 4, AdamW moments
    8 per parameter, and the bf16 copies autocast makes for forward, which backward keeps (with the activations)."""
    shape = shape_of("Qwen/Qwen3-0.6B")
    kw = dict(layout="ddp", ranks=1, use_lora=False, lora_rank=16, micro_batch_tokens=4096, max_seq_len=1024)
    parts = rank_parts(shape, activation_checkpointing=False, **kw)
    assert (parts["parameters"], parts["gradients"], parts["optimizer"]) == (4 * shape.params, 4 * shape.params,
                                                                             8 * shape.params)  # fmt: skip
    bf16_state = rank_parts(shape, activation_checkpointing=False, master_bytes=2, **kw)
    assert parts["activations"] - bf16_state["activations"] == 2 * shape.params
    # checkpointing recomputes a layer at a time: only the head's and one layer's casts are alive together
    ckpt = rank_parts(shape, activation_checkpointing=True, **kw)
    ckpt_bf16 = rank_parts(shape, activation_checkpointing=True, master_bytes=2, **kw)
    assert 0 < ckpt["activations"] - ckpt_bf16["activations"] < 2 * shape.params // 3


def test_a_sync_of_changes_only_counts_the_snapshot():
    """sync_changed_only keeps the last-sent weights whole in the wire dtype (sync/delta.py) on the sending rank,
    whatever the layout shards; the printed plan names the part."""
    shape = shape_of("Qwen/Qwen3-0.6B")
    kw = dict(ranks=2, use_lora=False, lora_rank=16, max_seq_len=1024)
    for layout in ("ddp", "zero3"):
        plain = rank_parts(shape, layout=layout, activation_checkpointing=True, micro_batch_tokens=4096, **kw)
        snap = rank_parts(
            shape, layout=layout, activation_checkpointing=True, micro_batch_tokens=4096, sync_snapshot=True, **kw
        )
        assert snap["total"] - plain["total"] == snap["sync_snapshot"] == 2 * shape.params
        assert "sync_snapshot" not in plain
    for snapshot in (True, False):
        fit = fit_training(
            shape,
            80 * GIB,
            layout="zero3",
            micro_batch_size=4,
            micro_batch_tokens=None,
            activation_checkpointing=None,
            shared_with_server=False,
            sync_snapshot=snapshot,
            **kw,
        )
        named = f"sync snapshot {2 * shape.params / GIB:.2f}" in fit.describe()[0]
        assert named == snapshot
