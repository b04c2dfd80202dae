"""Generation-throughput benchmark: our CPU engine's HTTP server vs a sequential HF `generate` loop, and vs real
vLLM (CPU build) on the same model directory.

    /work/main/.venv/bin/python benchmarks/bench_engine.py [--quick] [--no-vllm] [--hidden 128 --layers 4]

Each request: one distinct chat prompt, max_tokens 64 with ignore_eos (every completion is exactly 64 tokens),
temperature 1, its own seed. Servers are driven with `openai.AsyncOpenAI`, `c` requests in flight at once;
tokens/s = completion tokens / wall time of the whole round. The sequential baseline runs the same prompts one
at a time through `model.generate(do_sample=True, max_new_tokens=64, min_new_tokens=64)` in this process
(before any server starts, so nothing competes for the 2 cores). Rates are medians of N rounds after a warm-up.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import arg_parser, finish, median, row, wait_for_quiet  # noqa: E402

NAME = "bench_engine"
VLLM_PYTHON = os.environ.get("VF_VLLM_PYTHON", "/work/main/.venv-vllm/bin/python")
MAX_TOKENS = 64
CONCURRENCY = (1, 8, 32)
GOAL_AT_32 = 3.0  # ours vs the sequential loop
TOPICS = ["primes", "rivers", "owls", "jazz", "glass", "tides", "maps", "salt", "kites", "moss", "bells", "ink"]


def prompts(n: int) -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"Request {i}: write a short note about {TOPICS[i % len(TOPICS)]}."}]
        for i in range(n)
    ]


# ---------------------------------------------------------------------------------------- baseline


def hf_sequential(model, tokenizer, n: int, seed0: int) -> dict:
    """One request at a time: `model.generate` with sampling and a fixed length of MAX_TOKENS new tokens."""
    tokens = 0
    t0 = time.perf_counter()
    for i, msgs in enumerate(prompts(n)):
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]
        x = torch.tensor([ids])
        torch.manual_seed(seed0 + i)
        with torch.no_grad():
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                pad_token_id=tokenizer.pad_token_id,
            )
        tokens += out.shape[1] - x.shape[1]
    dt = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}


# ---------------------------------------------------------------------------------------- servers


async def _round(client, model_name: str, n: int, seed0: int) -> dict:
    async def one(i: int, msgs):
        r = await client.chat.completions.create(
            model=model_name,
            messages=msgs,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed0 + i,
            extra_body={"ignore_eos": True},
        )
        return r.usage.completion_tokens

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i, m) for i, m in enumerate(prompts(n))))
    dt = time.perf_counter() - t0
    if any(c != MAX_TOKENS for c in counts):
        raise RuntimeError(f"expected {MAX_TOKENS} completion tokens per request (ignore_eos), got {counts}")
    return {"tokens": sum(counts), "seconds": dt, "tokens_per_s": sum(counts) / dt}


async def _server_rates(base_url: str, model_name: str, levels, repeats: int) -> dict:
    from openai import AsyncOpenAI

    out = {}
    async with AsyncOpenAI(base_url=base_url + "/v1", api_key="EMPTY", timeout=600, max_retries=0) as client:
        await _round(client, model_name, 2, 999)  # first-request warm-up
        for c in levels:
            await _round(client, model_name, c, 10_000)  # warm-up at this concurrency
            rounds = [await _round(client, model_name, c, 1000 * (r + 1)) for r in range(repeats)]
            out[c] = {
                "tokens_per_s": median([r["tokens_per_s"] for r in rounds]),
                "all_tokens_per_s": [r["tokens_per_s"] for r in rounds],
                "seconds": median([r["seconds"] for r in rounds]),
            }
    return out


def server_rates(engine: str, model_dir: str, levels, repeats: int, tmp: str, log) -> dict:
    from verifiers_rl.rl.inference.launcher import InferenceServer

    if engine == "cpu":
        server = InferenceServer(
            model_dir,
            engine="cpu",
            output_dir=os.path.join(tmp, "out-cpu"),
            extra_args=["--max-model-len", "1024", "--max-num-seqs", "32", "--log-level", "warning"],
            startup_timeout=300,
        )
    else:
        server = InferenceServer(
            model_dir,
            engine="vllm",
            output_dir=os.path.join(tmp, "out-vllm"),
            python=VLLM_PYTHON,
            extra_args=[
                "--weight-transfer-backend",
                "gloo",
                "--max-model-len",
                "1024",
                "--dtype",
                "float32",
                "--enforce-eager",
                "--max-num-seqs",
                "32",
            ],
            env={"VLLM_CPU_KVCACHE_SPACE": "1"},
            startup_timeout=300,
        )
    t0 = time.perf_counter()
    with server:
        log(f"{engine} server up in {time.perf_counter() - t0:.1f}s")
        return asyncio.run(_server_rates(server.base_url, model_dir, levels, repeats))


# ---------------------------------------------------------------------------------------- run


def run(
    quick: bool = False, vllm: bool = True, hidden: int = 128, layers: int = 4, wait_quiet: float | None = None
) -> dict:
    from verifiers_rl.tiny import build_tiny_model, save_tiny_model

    repeats = 1 if quick else 3
    use_vllm = vllm and not quick and os.path.exists(VLLM_PYTHON)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    quiet = wait_for_quiet((0 if quick else 180) if wait_quiet is None else wait_quiet, log=log)
    model, tokenizer = build_tiny_model(hidden=hidden, layers=layers)
    n_params = sum(p.numel() for p in model.parameters())
    results: dict = {
        "name": NAME,
        "quick": quick,
        "repeats": repeats,
        "max_tokens": MAX_TOKENS,
        "model": {"hidden": hidden, "layers": layers, "params": n_params},
        "hf_sequential": {},
        "ours": {},
        "machine_before": quiet,
    }
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp:
        model_dir = str(save_tiny_model(os.path.join(tmp, "model"), hidden=hidden, layers=layers))
        # Sequential baseline first, alone on the machine. Its rate does not depend on c, so quick mode measures
        # it once on 8 requests and reuses it for every level.
        hf_sequential(model, tokenizer, 2, 0)  # warm-up
        for c in CONCURRENCY:
            n = 8 if quick else c
            if quick and c != CONCURRENCY[0] and 8 in results["hf_sequential"]:
                results["hf_sequential"][c] = results["hf_sequential"][8]
                continue
            runs = [hf_sequential(model, tokenizer, n, 1000 * (r + 1)) for r in range(repeats)]
            results["hf_sequential"][c] = {
                "tokens_per_s": median([r["tokens_per_s"] for r in runs]),
                "all_tokens_per_s": [r["tokens_per_s"] for r in runs],
                "requests": n,
            }
            if quick:
                results["hf_sequential"][8] = results["hf_sequential"][c]
            log(f"HF sequential ({n} requests): {results['hf_sequential'][c]['tokens_per_s']:.0f} tok/s")
        del model
        results["ours"] = server_rates("cpu", model_dir, CONCURRENCY, repeats, tmp, log)
        log("ours: " + ", ".join(f"c={c}: {v['tokens_per_s']:.0f} tok/s" for c, v in results["ours"].items()))
        if use_vllm:
            try:
                results["vllm"] = server_rates("vllm", model_dir, CONCURRENCY, repeats, tmp, log)
                log("vLLM: " + ", ".join(f"c={c}: {v['tokens_per_s']:.0f} tok/s" for c, v in results["vllm"].items()))
            except Exception as e:  # noqa: BLE001 - report, don't lose the rest of the results
                results["vllm_error"] = f"{type(e).__name__}: {e}"[:2000]
                log(f"vLLM failed: {results['vllm_error']}")
        else:
            results["vllm_skipped"] = "quick" if quick else ("--no-vllm" if not vllm else f"{VLLM_PYTHON} missing")

    rows = []
    for c in CONCURRENCY:
        hf, ours = results["hf_sequential"][c]["tokens_per_s"], results["ours"][c]["tokens_per_s"]
        goal = c == 32
        rows.append(
            row(
                f"c={c}: HF sequential loop vs ours",
                hf,
                ours,
                ours / hf,
                f">={GOAL_AT_32:.0f}x" if goal else "(report)",
                (ours / hf >= GOAL_AT_32) if goal else None,
                unit="tok/s",
            )
        )
    if "vllm" in results:
        for c in CONCURRENCY:
            v, ours = results["vllm"][c]["tokens_per_s"], results["ours"][c]["tokens_per_s"]
            rows.append(row(f"c={c}: vLLM (CPU) vs ours", v, ours, ours / v, "(report)", None, unit="tok/s"))
    title = (
        f"generation throughput ({'quick' if quick else 'full'}; Qwen3 tiny hidden {hidden} x {layers} layers, "
        f"{n_params / 1e6:.2f}M params; {MAX_TOKENS} tokens/request; median of {repeats})"
    )
    notes = (f"vLLM skipped: {results['vllm_skipped']}",) if "vllm_skipped" in results else ()
    return finish(NAME, quick, results, t_start, [(title, rows)], notes)


def main(argv=None) -> int:
    p = arg_parser(__doc__, "one round per level, no vLLM (< 60 s)")
    p.add_argument("--no-vllm", action="store_true", help="skip the real-vLLM comparison")
    p.add_argument("--hidden", type=int, default=128, help="tiny model width (multiple of 32; default 128)")
    p.add_argument("--layers", type=int, default=4, help="tiny model depth (default 4)")
    args = p.parse_args(argv)
    res = run(
        quick=args.quick, vllm=not args.no_vllm, hidden=args.hidden, layers=args.layers, wait_quiet=args.wait_quiet
    )
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
