"""The trainer's micro-batch layouts on a GPU: plain packing and shared prompts under a dense mask, through the
trainer's own `run_microbatches` on a real CUDA device. (A third layout, shared prompts attended by span, was
removed: it was slower than the dense mask here and on CPU; the committed H100 run still holds its rows.)

    python benchmarks/gpu_prefix_layouts.py [--out DIR]        # a machine with CUDA (not run by CI)
    python benchmarks/gpu_prefix_layouts.py --cpu --small      # any machine: the same checks, small shapes

Checks, per dtype (bfloat16 on CUDA only): the layouts give the same LoRA gradients and loss (float32:
relative 1e-4; bfloat16: reported), and the model's attention implementation is left as it was. Times: forward +
backward of one step (median of repeats, CUDA synchronised) and peak CUDA memory, at the Qwen3-0.6B shape
(byte vocabulary) with LoRA r16 on every projection, 8 prompts x 8 rollouts, for two prompt/completion shapes.
Writes prefix_layouts.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

SHAPE_06B = dict(
    hidden=1024, layers=28, head_dim=128, num_attention_heads=16, num_key_value_heads=8, intermediate_size=3072
)


def lora_policy(shape: dict, dtype: torch.dtype, device: str, seed: int = 0):
    from peft import LoraConfig, get_peft_model

    from verifiers_rl.config.rl_config import DEFAULT_LORA_TARGETS
    from verifiers_rl.tiny import build_tiny_model

    model, _ = build_tiny_model(seed=seed, **shape)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=list(DEFAULT_LORA_TARGETS)))
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)  # a real adapter delta, so gradients reach A too
    model.to(device=device, dtype=dtype)
    model.config._attn_implementation = "sdpa"
    model.train()
    return model


def batch(prompt: int, completion: int, groups: int = 8, group: int = 8, seed: int = 0):
    from verifiers_rl.batch.samples import PreparedBatch, Sample

    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        p = [rng.randrange(250) for _ in range(prompt)]
        for k in range(group):
            n = rng.randint(completion // 2, completion)  # rollouts end at different lengths
            c = [rng.randrange(250) for _ in range(n)]
            logps = [-rng.random() for _ in c]
            samples.append(
                Sample(p + c, [False] * prompt + [True] * n, [0.0] * prompt + logps, rng.gauss(0, 1), g * group + k, g)
            )
    tokens = sum(sum(s.loss_mask) for s in samples)
    return PreparedBatch(samples, tokens, len(samples), {}, {})


def step_args(share: bool, micro: int, seq: int):
    return SimpleNamespace(
        pack_sequences=True, share_prompt_prefix=share, micro_batch_size=micro, token_budget=micro * seq,
        temperature=1.0, kl_beta=0.0, loss_type="dapo", max_tokens=seq, max_seq_len=seq, mask_ratio_low=0.125,
        mask_ratio_high=8.0, epsilon=0.2, epsilon_high=0.28,
    )  # fmt: skip


def one_step(acc, model, prepared, layout: str, micro: int, seq: int, device: str):
    import verifiers_rl.trainer.policy_step as ps

    from_plan = ps._shared_plan
    if layout == "plain":
        ps._shared_plan = lambda *a, **k: None
    else:
        ps._shared_plan = lambda samples, plain, args, m: _all_shared(samples, args)
    try:
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss, metrics = ps.run_microbatches(acc, model, prepared, step_args(layout != "plain", micro, seq), 0)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    finally:
        ps._shared_plan = from_plan
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss), metrics, seconds, peak, grads


def _all_shared(samples, args):
    """The shared layout whatever the cost model says (for comparing layouts)."""
    from verifiers_rl.batch.microbatches import plan_microbatches
    from verifiers_rl.batch.prefix_sharing import plan_units, unit_length

    units = plan_units(samples, args.micro_batch_size, args.token_budget)
    lengths = [len(s.input_ids) for s in samples]
    sizes = [unit_length([lengths[i] for i in idx], p) for idx, p in units]
    counts = [len(idx) for idx, _ in units]
    plan = plan_microbatches(sizes, args.token_budget, packed=True, max_samples=args.micro_batch_size, sizes=counts)
    return [[units[u] for u in mb] for mb in plan]


def rel_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for n in a:
        scale = float(a[n].abs().max()) + 1e-12
        worst = max(worst, float((b[n] - a[n]).abs().max()) / scale)
    return worst


def compare(shape, dtype, device, prompt, completion, micro, repeats, log) -> dict:
    from accelerate import Accelerator

    import verifiers_rl.trainer.policy_step as ps

    acc = Accelerator(cpu=device == "cpu")
    model = lora_policy(shape, dtype, device)
    prepared = batch(prompt, completion)
    seq = prompt + completion
    out = {"prompt": prompt, "completion": completion, "dtype": str(dtype), "micro_batch_size": micro}
    grads = {}
    for layout in ("plain", "dense"):
        times, peaks = [], []
        for _ in range(repeats):
            loss, metrics, seconds, peak, g = one_step(acc, model, prepared, layout, micro, seq, device)
            times.append(seconds)
            peaks.append(peak)
        grads[layout] = g
        out[layout] = {
            "loss": loss, "s": statistics.median(times[1:] or times), "times": times, "peak_gib": max(peaks),
            "shared_prefix_frac": metrics["shared_prefix_frac"], "microbatches": metrics["microbatches"],
        }  # fmt: skip
        log(f"  {layout:5s}: {out[layout]['s'] * 1e3:8.1f} ms, peak {max(peaks):6.2f} GiB, loss {loss:+.6f}")
    out["dense_grad_rel_diff"] = rel_diff(grads["plain"], grads["dense"])
    out["attn_after"] = model.config._attn_implementation
    chosen = ps.microbatches(acc, model, prepared, step_args(True, micro, seq), 0)
    shared = chosen[0].num_shared_tokens > 0
    out["auto_layout"] = "dense" if shared else "plain"
    log(f"  grads vs plain: dense {out['dense_grad_rel_diff']:.2e}; "
        f"attention after: {out['attn_after']}; the cost model picks {out['auto_layout']}")  # fmt: skip
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--small", action="store_true", help="a 2-layer h128 model and short sequences")
    a = ap.parse_args(argv)
    device = "cpu" if a.cpu or not torch.cuda.is_available() else "cuda"

    def log(msg):
        print(msg, flush=True)

    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "device": device}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    log(json.dumps(info))
    results = {"info": info, "checks": [], "timings": []}
    failures = []
    small = dict(hidden=128, layers=2, head_dim=32)
    check_shape = small if a.small else {**SHAPE_06B, "layers": 4}
    for dtype in (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,):
        log(f"check: {'small' if a.small else '0.6B shape, 4 layers'} {dtype}, prompt 96, completion 48")
        r = compare(check_shape, dtype, device, 96, 48, 16, 1 if a.small else 2, log)
        results["checks"].append(r)
        if dtype == torch.float32:
            if not r["dense_grad_rel_diff"] < 1e-4:
                failures.append(f"dense gradients differ from plain: {r['dense_grad_rel_diff']:.2e}")
        if r["attn_after"] != "sdpa":
            failures.append(f"attention implementation left as {r['attn_after']}")
    shape = small if a.small else SHAPE_06B
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = [(64, 32)] if a.small else [(512, 256), (128, 512)]
    for prompt, completion in shapes:
        log(f"timing: {'small' if a.small else 'Qwen3-0.6B shape'} {dtype}, 8x8 rollouts, prompt {prompt}, "
            f"completion up to {completion}")  # fmt: skip
        results["timings"].append(compare(shape, dtype, device, prompt, completion, 16, 1 if a.small else 4, log))
    results["failures"] = failures
    path = os.path.join(a.out, "prefix_layouts.json")
    os.makedirs(a.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    log(f"{'FAILED: ' + '; '.join(failures) if failures else 'all checks passed'} -> {path}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
