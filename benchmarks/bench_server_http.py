"""CPU server HTTP benchmark: the server's CPU time per chat request, FastAPI's route on uvicorn's pure-Python h11
parser (what the server did before) vs the chat fast path on httptools (what it does now).

    .venv/bin/python benchmarks/bench_server_http.py [--quick]

Three CPU-engine servers on the same tiny model, each `app.serve` in a process of its own (started and stopped by
the trainer's launcher), differing only in the chat route (`fast_chat`) and uvicorn's parser (`http`): FastAPI + h11
(baseline), fast path + h11, fast path + httptools (ours). Each round sends C chat requests at once to one server,
as the trainer's rollouts do (RLConfig's sampling args, `max_tokens` tokens, logprobs and token ids), and reads that
server's CPU time from /proc before and after; the servers take turns round by round so all three see the same
machine. Reported: each server's CPU over all timed rounds per request (the kernel counts CPU time in 10 ms ticks, a
sixth of a 64-request round's, so single rounds are too coarse to take a median of).

Why it matters: the server's HTTP work holds the GIL its decode loop needs, so it is on the generation's critical
path, and generation is the longer half of an async step on 2 cores (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import cpu_server, finish, main_for, row, wait_for_quiet  # noqa: E402
from bench_async import _pid_cpu_s  # noqa: E402

NAME = "bench_server_http"
MSG = [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": "the quick brown fox"}]
VARIANTS = {  # name -> (fast_chat, uvicorn http)
    "FastAPI + h11": (False, "h11"),
    "fast path + h11": (True, "h11"),
    "ours": (True, "httptools"),
}


def measure(servers: dict, model: str, concurrency: int, rounds: int, max_tokens: int) -> dict:
    import aiohttp

    from verifiers_rl.rollouts.client import chat_request_body
    from verifiers_rl.trainer import RLConfig

    sampling = RLConfig(output_dir="unused", use_cpu=True, max_tokens=max_tokens, report_to="none").sampling_args

    async def go():
        seen = {name: [] for name in servers}  # CPU seconds per timed round
        async with aiohttp.ClientSession() as session:

            async def one(port: int, i: int):
                body, _ = chat_request_body(model, MSG, {**sampling, "seed": i})
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                async with session.post(
                    url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
                ) as r:
                    assert r.status == 200, await r.text()
                    await r.read()

            for r in range(rounds + 1):
                for name, server in servers.items():
                    c0 = _pid_cpu_s(server.process.pid)
                    await asyncio.gather(*(one(server.port, i) for i in range(concurrency)))
                    if r:  # round 0 warms connections and caches
                        seen[name].append(_pid_cpu_s(server.process.pid) - c0)
        return {
            name: {"cpu_ms_per_request": sum(xs) / (len(xs) * concurrency) * 1e3, "round_cpu_s": xs}
            for name, xs in seen.items()
        }

    return asyncio.run(go())


def run(quick: bool = False, wait_quiet: float | None = None) -> dict:
    from verifiers_rl.tiny import save_tiny_model

    t_start = time.perf_counter()
    concurrency, rounds, max_tokens = (16, 3, 4) if quick else (64, 30, 8)
    results: dict = {
        "name": NAME,
        "quick": quick,
        "concurrency": concurrency,
        "rounds": rounds,
        "max_tokens": max_tokens,
    }
    servers: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench_server_http_") as tmp:
        model = str(save_tiny_model(os.path.join(tmp, "tiny"), hidden=128, layers=2))
        try:
            for name, (fast, http) in VARIANTS.items():
                servers[name] = cpu_server(
                    model, os.path.join(tmp, f"server-{len(servers)}"), fast_chat=fast, http=http
                )
                servers[name].start()
            results["machine_before"] = wait_for_quiet((0 if quick else 60) if wait_quiet is None else wait_quiet)
            results["servers"] = m = measure(servers, model, concurrency, rounds, max_tokens)
        finally:
            for server in servers.values():
                server.stop()
    base, fast_h11, ours = (m[n]["cpu_ms_per_request"] for n in VARIANTS)
    rows = [
        row(f"server CPU per chat request, {concurrency} in flight, {max_tokens} tokens: FastAPI + h11 vs ours "
            "(fast path + httptools)", base, ours, base / ours, "(report)", None, unit="ms"),
        row("the same: FastAPI + h11 vs the fast path alone (h11)", base, fast_h11, base / fast_h11, "(report)", None,
            unit="ms"),
    ]  # fmt: skip
    return finish(NAME, quick, results, t_start, [(f"CPU server HTTP ({'quick' if quick else 'full'})", rows)])


def main(argv=None) -> int:
    return main_for(run, __doc__, "3 rounds of 16 requests (checks that it runs)", argv)


if __name__ == "__main__":
    sys.exit(main())
