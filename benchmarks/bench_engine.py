"""Generation-throughput benchmark: our CPU engine's HTTP server (the slot engine, and transformers' continuous
batching it replaced) vs real vLLM (CPU build) on the same model directory, and vs in-process HF `generate`.

    .venv/bin/python benchmarks/bench_engine.py [--quick] [--no-vllm] [--hidden 128 --layers 4]

Each request: one chat prompt, max_tokens 64 with ignore_eos (every completion is exactly 64 tokens),
temperature 1, its own seed. Servers are driven with `openai.AsyncOpenAI`, `c` requests in flight at once;
tokens/s = completion tokens / wall time of the whole round. Two workloads:

- `distinct`: c distinct prompts, at c = 1, 8, 32, 64;
- `grpo`: the end-to-end workload's shape, 8 prompts x 4 rollouts = 32 requests at once (each rollout is its
  own request, as verifiers sends them).

All servers are up together (idle ones cost nothing) and run round by round in turn, so a noisy neighbour on
this 2-core machine hits them alike; rates are medians of N rounds after a warm-up round. TRL's way of generating
without vLLM, one left-padded batched `model.generate` over all c prompts (`grpo`: the 32 rows), runs in this
process in the same rotation (the servers are idle meanwhile), with torch's default threads and with one thread:
the better of the two is the baseline. A sequential HF `generate` loop (one request at a
time, on up to 8 requests) runs first, before any server starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import arg_parser, finish, median, row, wait_for_quiet  # noqa: E402

NAME = "bench_engine"
# the README's vLLM CPU venv (`bash .ci/vllm-cpu-venv.sh .venv-vllm`) at the repository root
VLLM_PYTHON = os.environ.get(
    "VF_VLLM_PYTHON", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-vllm/bin/python")
)
MAX_TOKENS = 64
CONCURRENCY = (1, 8, 32, 64)
GRPO = (8, 4)  # prompts x rollouts
GOAL_AT_32 = 3.0  # ours vs the sequential loop
TOPICS = ["primes", "rivers", "owls", "jazz", "glass", "tides", "maps", "salt", "kites", "moss", "bells", "ink"]
SERVERS = ("ours", "ours_cb", "vllm")


def prompts(n: int) -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"Request {i}: write a short note about {TOPICS[i % len(TOPICS)]}."}]
        for i in range(n)
    ]


def workload(name: str) -> list[list[dict]]:
    if name == "grpo":
        p, g = GRPO
        return [m for m in prompts(p) for _ in range(g)]
    return prompts(int(name))


# ---------------------------------------------------------------------------------------- in-process baselines


def _ids(tokenizer, msgs) -> list[int]:
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"]


def _generate(model, tokenizer, batch: list[list[int]]) -> int:
    """One `model.generate` over the batch (left-padded, as TRL does); returns the new tokens."""
    width = max(len(x) for x in batch)
    pad = tokenizer.pad_token_id
    x = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
    with torch.no_grad():
        out = model.generate(
            x, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, pad_token_id=pad,
        )  # fmt: skip
    return (out.shape[1] - width) * len(batch)


def hf_rate(model, tokenizer, load: str, batched: bool, seed: int, threads: int | None = None) -> float:
    batch = [_ids(tokenizer, m) for m in workload(load)]
    torch.manual_seed(seed)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        t0 = time.perf_counter()
        tokens = _generate(model, tokenizer, batch) if batched else sum(_generate(model, tokenizer, [b]) for b in batch)
        return tokens / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------- servers


async def _round(client, model_name: str, msgs: list, seed0: int) -> float:
    async def one(i: int, m):
        r = await client.chat.completions.create(
            model=model_name, messages=m, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed0 + i,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return r.usage.completion_tokens

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i, m) for i, m in enumerate(msgs)))
    dt = time.perf_counter() - t0
    if any(c != MAX_TOKENS for c in counts):
        raise RuntimeError(f"expected {MAX_TOKENS} completion tokens per request (ignore_eos), got {counts}")
    return sum(counts) / dt


def _server(kind: str, model_dir: str, tmp: str):
    from verifiers_rl.serving.launcher import InferenceServer

    common = ["--max-model-len", "1024", "--max-num-seqs", "64"]
    if kind in ("ours", "ours_cb"):
        impl = "slots" if kind == "ours" else "cb"
        return InferenceServer(
            model_dir, engine="cpu", output_dir=os.path.join(tmp, f"out-{kind}"), startup_timeout=300,
            extra_args=[*common, "--cpu-engine", impl, "--log-level", "warning"],
        )  # fmt: skip
    return InferenceServer(
        model_dir, engine="vllm", output_dir=os.path.join(tmp, "out-vllm"), python=VLLM_PYTHON,
        # Larger than any round's prompts: vLLM-cpu 0.32 crashes when a seeded request's prefill is chunked
        # ("CPU Generator does not use offset"), which 64 concurrent prompts trigger at the default.
        extra_args=["--weight-transfer-backend", "gloo", *common, "--dtype", "float32", "--enforce-eager",
                    "--max-num-batched-tokens", "8192"],
        env={"VLLM_CPU_KVCACHE_SPACE": "1"}, startup_timeout=300,
    )  # fmt: skip


async def _interleaved(urls: dict[str, str], model_name: str, loads, repeats: int, log, local=None) -> dict:
    """Rounds of every participant in turn: the servers at `urls`, and `local` in-process runners
    (name -> fn(load, seed) -> tokens/s), which run while the servers sit idle."""
    from openai import AsyncOpenAI

    # Retries only for connection errors: a client idle while the others run its rounds can find its pooled
    # connection closed by the server's 5 s keep-alive (uvicorn's default, vLLM's too).
    clients = {k: AsyncOpenAI(base_url=u + "/v1", api_key="EMPTY", timeout=600, max_retries=2) for k, u in urls.items()}
    local = local or {}

    async def one_round(k, load, seed):
        if k in local:
            return local[k](load, seed)
        return await _round(clients[k], model_name, workload(load), seed)

    names = list(local) + list(clients)
    out: dict = {k: {} for k in names}
    try:
        for k in names:
            await one_round(k, "2", 999)  # first-request warm-up
        for load in loads:
            for k in names:
                await one_round(k, load, 10_000)  # warm-up at this load
            rates: dict = {k: [] for k in names}
            for r in range(repeats):
                for k in names:
                    rates[k].append(await one_round(k, load, 1000 * (r + 1)))
            for k, v in rates.items():
                out[k][load] = {"tokens_per_s": median(v), "all_tokens_per_s": v}
            log(f"load {load}: " + ", ".join(f"{k} {median(v):.0f}" for k, v in rates.items()) + " tok/s")
    finally:
        for c in clients.values():
            await c.close()
    return out


# ---------------------------------------------------------------------------------------- run


def run(
    quick: bool = False, vllm: bool = True, hidden: int = 128, layers: int = 4, wait_quiet: float | None = None
) -> dict:
    from verifiers_rl.tiny import build_tiny_model, save_tiny_model

    repeats = 1 if quick else 3
    use_vllm = vllm and not quick and os.path.exists(VLLM_PYTHON)
    loads = [str(c) for c in ((1, 32) if quick else CONCURRENCY)] + ["grpo"]
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    quiet = wait_for_quiet((0 if quick else 180) if wait_quiet is None else wait_quiet, log=log)
    model, tokenizer = build_tiny_model(hidden=hidden, layers=layers)
    n_params = sum(p.numel() for p in model.parameters())
    results: dict = {
        "name": NAME, "quick": quick, "repeats": repeats, "max_tokens": MAX_TOKENS, "grpo_shape": GRPO,
        "model": {"hidden": hidden, "layers": layers, "params": n_params}, "torch_threads": torch.get_num_threads(),
        "hf_sequential": {}, "hf_batched": {}, "machine_before": quiet,
    }  # fmt: skip
    hf_rate(model, tokenizer, "2", False, 0)  # warm-up
    for load in loads:
        # The sequential rate does not depend on the load: measure it on up to 8 requests.
        seq_load = load if load == "1" else "8"
        if seq_load not in results["hf_sequential"]:
            runs = [hf_rate(model, tokenizer, seq_load, False, 1000 * (r + 1)) for r in range(repeats)]
            results["hf_sequential"][seq_load] = {"tokens_per_s": median(runs), "all_tokens_per_s": runs}
            log(f"HF sequential ({seq_load} requests): {median(runs):.0f} tok/s")
        results["hf_sequential"][load] = results["hf_sequential"][seq_load]

    kinds = [k for k in SERVERS if (k != "vllm" or use_vllm) and not (quick and k == "ours_cb")]
    if not use_vllm:
        results["vllm_skipped"] = "quick" if quick else ("--no-vllm" if not vllm else f"{VLLM_PYTHON} missing")
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as tmp, contextlib.ExitStack() as stack:
        model_dir = str(save_tiny_model(os.path.join(tmp, "model"), hidden=hidden, layers=layers))
        urls = {}
        for kind in kinds:
            t0 = time.perf_counter()
            try:
                srv = _server(kind, model_dir, tmp)
                stack.enter_context(srv)
                urls[kind] = srv.base_url
                log(f"{kind} server up in {time.perf_counter() - t0:.1f}s")
            except Exception as e:  # noqa: BLE001 - report, don't lose the rest of the results
                results[f"{kind}_error"] = f"{type(e).__name__}: {e}"[:2000]
                log(f"{kind} failed to start: {results[f'{kind}_error']}")
        # TRL-style batched generate runs in this process, interleaved with the servers' rounds, with torch's
        # default threads and with one (faster when other processes compete for the cores); the better counts
        local = {"hf_batched_1_thread": lambda load, seed: hf_rate(model, tokenizer, load, True, seed, threads=1)}
        if not quick:
            local["hf_batched_default_threads"] = lambda load, seed: hf_rate(model, tokenizer, load, True, seed)
        results.update(asyncio.run(_interleaved(urls, model_dir, loads, repeats, log, local)))
        results["hf_batched"] = {
            load: max((results[k][load] for k in local), key=lambda r: r["tokens_per_s"]) for load in loads
        }

    def rate(kind, load):
        return results.get(kind, {}).get(load, {}).get("tokens_per_s")

    rows = [
        row("c=32: HF sequential loop vs ours", rate("hf_sequential", "32"), rate("ours", "32"),
            rate("ours", "32") / rate("hf_sequential", "32"), f">={GOAL_AT_32:.0f}x",
            rate("ours", "32") / rate("hf_sequential", "32") >= GOAL_AT_32, unit="tok/s"),
        row(f"grpo {GRPO[0]}x{GRPO[1]}: HF batched generate (TRL) vs ours", rate("hf_batched", "grpo"),
            rate("ours", "grpo"), rate("ours", "grpo") / rate("hf_batched", "grpo"), ">=1x",
            rate("ours", "grpo") >= rate("hf_batched", "grpo"), unit="tok/s"),
    ]  # fmt: skip
    if rate("vllm", "32"):
        rows.append(row("c=32: vLLM (CPU build) vs ours", rate("vllm", "32"), rate("ours", "32"),
                        rate("ours", "32") / rate("vllm", "32"), ">=1x", rate("ours", "32") >= rate("vllm", "32"),
                        unit="tok/s"))  # fmt: skip
    report = []
    for load in loads:
        ours = rate("ours", load)
        for base in ("hf_sequential", "hf_batched", "ours_cb", "vllm"):
            b = rate(base, load)
            if b and ours:
                label = {"ours_cb": "old CB engine"}.get(base, base)
                report.append(row(f"{load}: {label} vs ours", b, ours, ours / b, "(report)", None, unit="tok/s"))
    title = (
        f"generation throughput ({'quick' if quick else 'full'}; Qwen3 tiny hidden {hidden} x {layers} layers, "
        f"{n_params / 1e6:.2f}M params; {MAX_TOKENS} tokens/request; median of {repeats})"
    )
    notes = (f"vLLM skipped: {results['vllm_skipped']}",) if "vllm_skipped" in results else ()
    return finish(NAME, quick, results, t_start, [(title, rows), ("all loads (load = concurrent requests)", report)],
                  notes)  # fmt: skip


def main(argv=None) -> int:
    p = arg_parser(__doc__, "one round per level, c = 1 / 32 / grpo, no vLLM or old engine (~1 minute)")
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
