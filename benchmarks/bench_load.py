"""Load benchmark: many concurrent requests to the inference server while the trainer syncs weights into it.

    .venv/bin/python benchmarks/bench_load.py [--quick]

One CPU-engine server on the tiny model. A round is N chat requests sent at once (each as the trainer sends it:
logprobs, token ids, a seed, 16 tokens); latency is measured per request from send to the whole reply. Rounds
alternate (and which goes first alternates too): without syncs (the baseline) and with weight syncs back to back in
another thread for the whole round
(the trainer's gloo sync, each one real new weights: the policy scaled a little further every time). A request
fails when its status is not 200 or its reply lacks the token ids and logprobs the trainer needs. Full: N = 512,
2 rounds of each; quick: N = 64, 1 round of each.

Rows: failed requests with syncs (goal 0, over every round and sync), and p50 / p99 latency with syncs against
without (reported: a sync pauses generation while the weights move, so in-flight requests wait for it).
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import finish, main_for, row, wait_for_quiet  # noqa: E402

NAME = "bench_load"


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


async def one_round(url: str, model: str, n: int, tag: str) -> tuple[list[float], int]:
    """(latencies in s, failed requests) of n requests sent at once."""
    import aiohttp

    async def request(session, i: int):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"Reverse the text: request {i} of round {tag}"}],
            "max_tokens": 16,
            "temperature": 1.0,
            "logprobs": True,
            "return_token_ids": True,
            "seed": i,
        }
        t0 = time.perf_counter()
        try:
            async with session.post(url, json=body) as reply:
                data = await reply.json()
                ok = reply.status == 200 and bool(data["choices"][0].get("token_ids"))
                ok = ok and bool(data["choices"][0]["logprobs"]["content"])
        except Exception:  # noqa: BLE001 - a failed request is what this benchmark counts
            ok = False
        return time.perf_counter() - t0, ok

    connector = aiohttp.TCPConnector(limit=n)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        out = await asyncio.gather(*[request(session, i) for i in range(n)])
    return [t for t, _ in out], sum(not ok for _, ok in out)


class Syncer(threading.Thread):
    """Weight syncs back to back (a short gap between them) until stopped; counts them and their failures."""

    def __init__(self, client, model):
        super().__init__(daemon=True)
        self.client, self.model = client, model
        self.stop, self.done, self.failed, self.version = threading.Event(), 0, 0, 0
        self.base = {k: v.detach().clone() for k, v in model.named_parameters()}

    def run(self):
        while not self.stop.is_set():
            self.version += 1
            scale = 1.0 + 1e-3 * self.version
            tensors = [(k, v * scale) for k, v in self.base.items()]
            try:
                self.client.update_weights(tensors, version=self.version)
                self.done += 1
            except Exception:  # noqa: BLE001 - counted: a sync that fails under load is a failure of this benchmark
                self.failed += 1
            self.stop.wait(0.05)


def measure(client, model, n: int, rounds: int) -> dict:
    url = client.base_url + "/v1/chat/completions"
    name = client.models()[0]["id"]
    asyncio.run(one_round(url, name, 16, "warm-up"))
    seen = {"baseline": [], "syncs": []}
    failed = {"baseline": 0, "syncs": 0}
    syncs = sync_failures = 0
    for r in range(rounds):
        for mode in ("baseline", "syncs") if r % 2 == 0 else ("syncs", "baseline"):  # neither always goes first
            syncer = Syncer(client, model) if mode == "syncs" else None
            if syncer is not None:
                syncer.start()
            lat, bad = asyncio.run(one_round(url, name, n, f"{r}-{mode}"))
            if syncer is not None:
                syncer.stop.set()
                syncer.join(60)
                syncs, sync_failures = syncs + syncer.done, sync_failures + syncer.failed
            seen[mode] += lat
            failed[mode] += bad
    stats = {k: {"p50": percentile(v, 0.5), "p99": percentile(v, 0.99), "requests": len(v)} for k, v in seen.items()}
    return {"latency_s": stats, "failed": failed, "syncs": syncs, "sync_failures": sync_failures}


def run(quick: bool = False, wait_quiet: float | None = None) -> dict:
    from verifiers_rl.serving.launcher import InferenceServer
    from verifiers_rl.tiny import build_tiny_model, save_tiny_model

    t_start = time.perf_counter()
    n, rounds = (64, 1) if quick else (512, 2)
    results: dict = {"name": NAME, "quick": quick, "concurrency": n, "rounds": rounds}
    with tempfile.TemporaryDirectory(prefix="bench_load_") as tmp:
        path = str(save_tiny_model(os.path.join(tmp, "tiny"), hidden=64, layers=2))
        model = build_tiny_model(hidden=64, layers=2)[0]
        server = InferenceServer(path, engine="cpu", output_dir=tmp, extra_args=["--max-model-len", "512"])
        client = server.start()
        try:
            client.init_weight_transfer("gloo", server_pauses=True)
            results["machine_before"] = wait_for_quiet((0 if quick else 120) if wait_quiet is None else wait_quiet)
            m = results["measured"] = measure(client, model, n, rounds)
        finally:
            server.stop()
    base, ours = m["latency_s"]["baseline"], m["latency_s"]["syncs"]
    total = m["latency_s"]["syncs"]["requests"]
    rows = [
        row(f"failed requests of {total} ({n} at once) across {m['syncs']} weight syncs", 0,
            m["failed"]["syncs"] + m["sync_failures"], None, "0", m["failed"]["syncs"] + m["sync_failures"] == 0),
        row(f"p50 latency, {n} concurrent requests: without vs across weight syncs", base["p50"], ours["p50"],
            ours["p50"] / base["p50"], "(report)", None, unit="s"),
        row(f"p99 latency, {n} concurrent requests: without vs across weight syncs", base["p99"], ours["p99"],
            ours["p99"] / base["p99"], "(report)", None, unit="s"),
    ]  # fmt: skip
    return finish(NAME, quick, results, t_start, [(f"load ({'quick' if quick else 'full'})", rows)])


def main(argv=None) -> int:
    return main_for(run, __doc__, "64 requests, 1 round of each (< 1 minute)", argv)


if __name__ == "__main__":
    sys.exit(main())
