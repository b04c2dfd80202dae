"""Calibrate and check the memory planner (`verifiers_rl.plan.memory.rank_parts`) on a real GPU.

For a Qwen3-0.6B-shaped model with random weights (bf16, offline), measures the trainer's peak CUDA memory for a
few optimizer steps of the trainer's own micro-batch loop shape (LoRA r=16 and full fine-tuning; with and
without gradient checkpointing; several micro-batch token budgets), and prints it next to the planner's
estimate for one DDP rank on its own GPU (its total, and that total less the CUDA context, which
`torch.cuda.max_memory_allocated` does not see: tests/unit/test_plan_memory.py checks the latter). Also moves a
merged-weight sync between two processes on the SAME GPU over our gloo group (host memory), checking the
receiver's weights bit for bit — the merged path of the shared-GPU layout, without NCCL.

    python benchmarks/shared_gpu_memory.py [--out results.json]

Needs CUDA; not run by CI (no GPU there). Results: benchmarks/results/shared_gpu_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from verifiers_rl.plan.memory import ModelShape, rank_parts  # noqa: E402

GIB = 1 << 30


def qwen3_06b(layers: int = 28):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    return model, cfg


def measure(use_lora: bool, tokens: int, checkpointing: bool, seq_len: int = 1024, steps: int = 3) -> dict:
    from peft import LoraConfig, get_peft_model

    from verifiers_rl.batch.microbatches import PaddedBatch
    from verifiers_rl.loss.forward import token_logprobs
    from verifiers_rl.sync.export import ReplicatedExport

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model, cfg = qwen3_06b()
    model.config._attn_implementation = "sdpa"
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if use_lora:
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets))
        if checkpointing:
            model.enable_input_require_grads()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    rows = max(tokens // seq_len, 1)
    static = torch.cuda.memory_allocated()
    head = ReplicatedExport(model)
    for _ in range(steps):
        ids = torch.randint(0, cfg.vocab_size, (rows, seq_len), device="cuda")
        mask = torch.zeros(rows, seq_len - 1, dtype=torch.bool, device="cuda")
        mask[:, seq_len // 4 :] = True  # the completion part of each sample is trained
        mb = PaddedBatch(  # padded layout with no padding: every row is a full sample
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            target_ids=ids[:, 1:],
            loss_mask=mask,
            sampler_logprobs=torch.zeros(mask.shape, device="cuda"),
            advantages=torch.ones(rows, device="cuda"),
            num_real_tokens=ids.numel(),
            num_padded_tokens=0,
            num_loss_tokens=int(mask.sum()),
            num_sequences=rows,
        )
        with torch.autocast("cuda", torch.bfloat16):  # bf16 = true: the trainer's forward runs under autocast
            logprobs, _ = token_logprobs(model, head, mb, 1.0)
            loss = -(logprobs * mask).sum() / mask.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    shape = ModelShape.from_config(cfg)
    est = rank_parts(  # one process on its own GPU: a single DDP rank
        shape,
        layout="ddp",
        ranks=1,
        use_lora=use_lora,
        lora_rank=16,
        micro_batch_tokens=rows * seq_len,
        max_seq_len=seq_len,  # every row is one full sample of seq_len tokens
        activation_checkpointing=checkpointing,
        param_bytes=2,
    )
    del model, opt
    torch.cuda.empty_cache()
    return {
        "use_lora": use_lora,
        "autocast": True,  # rows without this key were measured without it (results of 2026-11)
        "tokens": rows * seq_len,
        "checkpointing": checkpointing,
        "peak_gib": peak / GIB,
        "static_gib": static / GIB,
        "planner_gib": est["total"] / GIB,
        "planner_allocated_gib": (est["total"] - est["cuda_context"]) / GIB,  # what max_memory_allocated can see
        "planner_parts_gib": {k: v / GIB for k, v in est.items()},
    }


def _receiver(port: int, key: str, names_shapes: list, conn) -> None:
    from verifiers_rl.sync.buckets import TensorMeta, plan_buckets
    from verifiers_rl.sync.transport.gloo import GlooInitInfo, connect_group, receive_buckets

    torch.cuda.set_device(0)
    params = {n: torch.zeros(s, dtype=torch.bfloat16, device="cuda") for n, s in names_shapes}
    group = connect_group(GlooInitInfo("127.0.0.1", port, 1, 2, 64 << 20, 120, key), 1)
    metas = [TensorMeta(n, torch.bfloat16, tuple(s)) for n, s in names_shapes]
    t0 = time.perf_counter()

    def load(named):
        for name, view in named:
            params[name].copy_(view)  # host staging buffer -> this process's GPU copy

    receive_buckets(group, plan_buckets(metas, 64 << 20), load)
    torch.cuda.synchronize()
    conn.send((time.perf_counter() - t0, {n: float(p.float().sum()) for n, p in params.items()}))


def shared_gpu_sync() -> dict:
    """Trainer and receiver on one GPU; merged weights through host memory over gloo."""
    from verifiers_rl.sync.buckets import TensorMeta, plan_buckets
    from verifiers_rl.sync.transport.gloo import join_group, open_store, send_buckets

    model, _ = qwen3_06b()
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    names_shapes = [(n, list(t.shape)) for n, t in tensors.items()]
    store = open_store("127.0.0.1", 0, 2, 120)
    key = "calibration"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(store.port, key, names_shapes, child))
    proc.start()
    group = join_group(store, 0, 2, 120, key)
    metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    t0 = time.perf_counter()
    sent = send_buckets(group, plan_buckets(metas, 64 << 20), tensors.items())
    send_s = time.perf_counter() - t0
    recv_s, sums = parent.recv()
    proc.join(60)
    exact = all(abs(sums[n] - float(t.float().sum())) <= 1e-3 * max(1.0, abs(sums[n])) for n, t in tensors.items())
    return {"bytes": sent, "send_s": send_s, "receive_s": recv_s, "gb_per_s": sent / max(send_s, 1e-9) / 1e9,
            "exact": exact}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    rows = []
    for use_lora, tokens, ckpt in [
        (True, 4096, False),
        (True, 16384, False),
        (True, 16384, True),
        (False, 4096, False),
        (False, 16384, True),
    ]:
        rows.append(measure(use_lora, tokens, ckpt))
        r = rows[-1]
        print(
            f"lora={use_lora!s:5} tokens={tokens:6} ckpt={ckpt!s:5} peak {r['peak_gib']:.2f} GiB, "
            f"planner {r['planner_gib']:.2f} GiB, {r['planner_allocated_gib']:.2f} without the CUDA context "
            f"({r['planner_allocated_gib'] / r['peak_gib']:.2f}x)",
            flush=True,
        )
    sync = shared_gpu_sync()
    print(f"shared-GPU merged sync over gloo: {sync}", flush=True)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "trainer": rows, "sync": sync}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
