"""Adapter vs merged LoRA sync, for bench_sync.py: bytes and seconds per sync on our CPU engine and, when
VF_VLLM_PYTHON names a vLLM venv, on real vLLM (the CPU build), for the tiny model and a model of
Qwen3-0.6B's shape with random weights.

Both modes run on one server in interleaved rounds (same load conditions), over one gloo group: the merged
sender's, which the adapter sender borrows. A vLLM server runs in adapter mode (`layout.AdapterServing`); a
merged sync there also drops vLLM's adapters, which the next adapter sync puts back. One sync is what the
trainer pays: building the tensors (merging the deltas, or collecting the adapter), pause, send, resume.

The trainer side runs with half the cores (at least one thread), as the runtime splits them when trainer and
server share a machine (`runtime.cpu_thread_split`): with every core on an oversubscribed host, the many small
copies of a sync wait on OpenMP hand-offs (measured on 2 busy cores, 0.6B shape: packing the 40 MB adapter
0.03-0.06 s with one thread, 2-3 s with two).
"""

from __future__ import annotations

import gc
import os
import tempfile
import time

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 16, 32
# Qwen3-0.6B's config, weights random (no model hub here): 596M parameters, 2.4 GB in float32. The byte-level
# tokenizer has 259 ids; the model's vocabulary is larger, as Qwen's is.
QWEN3_06B = dict(
    hidden=1024,
    layers=28,
    head_dim=128,
    vocab_size=151936,
    intermediate_size=3072,
    num_attention_heads=16,
    num_key_value_heads=8,
    tie_word_embeddings=True,
)


def build_model(label: str):
    """(model, tokenizer) for "tiny" (verifiers_rl.tiny defaults) or "qwen3-0.6b-shape"."""
    from verifiers_rl.tiny import build_tiny_model

    return build_tiny_model() if label == "tiny" else build_tiny_model(**QWEN3_06B)


def _peft(model):
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS))
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01)  # B starts at zero: give the adapter a real delta
    return peft.eval()


def _server(engine: str, model_dir: str, out: str, serving):
    from verifiers_rl.serving.launcher import InferenceServer

    if engine == "cpu":
        from _common import sync_server

        return sync_server(model_dir, out, startup_timeout=600)
    args = ["--weight-transfer-backend", "gloo", "--dtype", "float32", "--max-model-len", "512"]
    args += ["--enforce-eager", "--max-num-seqs", "8"]
    return InferenceServer(
        model_dir,
        engine="vllm",
        output_dir=out,
        python=os.environ["VF_VLLM_PYTHON"],
        extra_args=args,
        adapter=serving,
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        startup_timeout=600,
    )


def _measure(client, peft, repeats: int, measure_interleaved) -> tuple[dict, dict]:
    from verifiers_rl.sync.policy_weights import adapter_weights, merged_weights
    from verifiers_rl.sync.transport.adapter import AdapterSender

    merged_sender = client.init_weight_transfer("gloo")
    adapter_sender = AdapterSender(client, bucket_bytes=merged_sender.bucket_bytes)
    adapter_sender.group = merged_sender.group  # the server reads the mode from each request
    versions = iter(range(1, 1 << 30))

    def timed(sender, tensors_of):
        def run():
            t = time.perf_counter()
            with client.paused():
                stats = sender.send(tensors_of(peft), next(versions))
            return time.perf_counter() - t, stats.bytes

        return run

    # adapter first: the CPU engine records its pristine base on the first adapter sync
    a, m = measure_interleaved([timed(adapter_sender, adapter_weights), timed(merged_sender, merged_weights)], repeats)
    a["tensors"] = sum(1 for _ in adapter_weights(peft))
    m["tensors"] = sum(1 for _ in merged_weights(peft))
    return a, m


def compare(label: str, engines: list[str], repeats: int, measure_interleaved, log) -> dict:
    """{engine: {"adapter": {...}, "merged": {...}, "startup_s": s, "trainer_threads": n}} for one model."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    try:
        return _compare(label, engines, repeats, measure_interleaved, log)
    finally:
        torch.set_num_threads(threads_before)


def _compare(label: str, engines: list[str], repeats: int, measure_interleaved, log) -> dict:
    from verifiers_rl.sync.transport.adapter import adapter_serving

    out: dict = {}
    with tempfile.TemporaryDirectory(prefix=f"bench_adapter_{label}_") as tmp:
        model, tok = build_model(label)
        model_dir = os.path.join(tmp, "model")
        model.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
        peft = _peft(model)
        serving = adapter_serving(peft, os.path.join(tmp, "adapter0"))
        params = sum(p.numel() for p in model.parameters())
        log(f"{label}: {params / 1e6:.0f}M params saved; LoRA r{RANK} on {len(TARGETS)} projections")
        for engine in engines:
            t0 = time.perf_counter()
            with _server(engine, model_dir, os.path.join(tmp, f"out_{engine}"), serving) as client:
                startup = time.perf_counter() - t0
                a, m = _measure(client, peft, repeats, measure_interleaved)
            out[engine] = {"adapter": a, "merged": m, "startup_s": startup, "trainer_threads": torch.get_num_threads()}
            log(
                f"{label} on {engine} (server up in {startup:.0f}s): adapter {a['bytes'] / 1e6:.1f} MB "
                f"{a['seconds']:.3f}s, merged {m['bytes'] / 1e6:.0f} MB {m['seconds']:.3f}s"
            )
        del peft, model
        gc.collect()
    return out


def rows(label: str, results: dict, row) -> list[dict]:
    """Two report rows per engine: bytes and seconds, merged as the baseline."""
    lines = []
    for engine, r in results.items():
        a, m = r["adapter"], r["merged"]
        name = f"LoRA r{RANK} {label} on {engine}: merged vs adapter ({m['tensors']} vs {a['tensors']} tensors)"
        ratio = m["bytes"] / a["bytes"]
        lines.append(row(name, m["bytes"] / 1e6, a["bytes"] / 1e6, ratio, "(report)", None, unit="MB"))
        lines.append(
            row(
                f"LoRA r{RANK} {label} on {engine}: merged vs adapter, s per sync",
                m["seconds"],
                a["seconds"],
                m["seconds"] / a["seconds"],
                "(report)",
                None,
                unit="s",
                adapter_all_seconds=a["all_seconds"],
                merged_all_seconds=m["all_seconds"],
            )
        )
    return lines
