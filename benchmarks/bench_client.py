"""Rollout client benchmark: the trainer-process CPU each rollout request costs, through the OpenAI SDK (what the
trainer used before, and what verifiers' own client does) vs our RolloutClient's lean request path.

    .venv/bin/python benchmarks/bench_client.py [--quick]

One CPU-engine server on the tiny model; C requests in flight at once, R rounds, each request as the trainer sends
it (RLConfig's sampling args, max_tokens 8, a per-rollout seed) and parsed into verifiers' Response. Client CPU is
this process's CPU time (the server is another process) per request, median over rounds after a warm-up round;
the clients alternate round by round so both see the same machine. The SDK with its optional aiohttp transport is
reported for reference: it keeps the SDK's request transforms and response construction.

Why it matters: the client runs in the trainer's process, on the cores that train. Goal: >= 3x less client CPU per
request than the SDK.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import finish, main_for, median, row, wait_for_quiet  # noqa: E402

NAME = "bench_client"
GOAL = 3.0  # SDK client CPU per request / ours
MSG = [{"role": "user", "content": "Reverse the text: the quick brown fox"}]


async def one_round(client, model: str, sampling: dict, concurrency: int, tag: str) -> tuple[float, float]:
    """(wall s, client CPU s) of `concurrency` requests in flight at once."""
    from verifiers_rl.rollouts.client import ROLLOUT_KEY

    async def request(i: int):
        reply = await client.get_native_response(MSG, model, sampling, state={"input": {ROLLOUT_KEY: f"{tag}:{i}"}})
        return await client.from_native_response(reply)

    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*[request(i) for i in range(concurrency)])
    return time.perf_counter() - t0, time.process_time() - c0


def measure(base_url: str, model: str, concurrency: int, rounds: int) -> dict:
    import openai
    from openai import AsyncOpenAI

    from verifiers_rl.rollouts.client import RolloutClient
    from verifiers_rl.trainer import RLConfig

    sampling = RLConfig(output_dir="unused", use_cpu=True, max_tokens=8, report_to="none").sampling_args

    def client(lean: bool, **http):
        return RolloutClient(AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120, **http), 0, lean)

    async def go():
        clients = {
            "sdk": client(False),
            "sdk + aiohttp": client(False, http_client=openai.DefaultAioHttpClient()),
            "ours": client(True),
        }
        seen = {name: [] for name in clients}
        try:
            for r in range(rounds + 1):
                for name, c in clients.items():
                    wall, cpu = await one_round(c, model, sampling, concurrency, f"{r}")
                    if r:  # round 0 warms connections and caches
                        seen[name].append((wall, cpu))
        finally:
            for c in clients.values():
                await c.close()
        return {
            name: {
                "cpu_ms_per_request": median([c for _, c in xs]) / concurrency * 1e3,
                "wall_ms_per_round": median([w for w, _ in xs]) * 1e3,
                "sdk_fallbacks": clients[name].sdk_fallbacks,
            }
            for name, xs in seen.items()
        }

    return asyncio.run(go())


def run(quick: bool = False, wait_quiet: float | None = None) -> dict:
    from verifiers_rl.serving.launcher import InferenceServer
    from verifiers_rl.tiny import save_tiny_model

    t_start = time.perf_counter()
    concurrency, rounds = (16, 3) if quick else (64, 12)
    results: dict = {"name": NAME, "quick": quick, "concurrency": concurrency, "rounds": rounds}
    with tempfile.TemporaryDirectory(prefix="bench_client_") as tmp:
        model = str(save_tiny_model(os.path.join(tmp, "tiny"), hidden=128, layers=2))
        server = InferenceServer(model, engine="cpu", output_dir=tmp)
        server.start()
        try:
            results["machine_before"] = wait_for_quiet((0 if quick else 60) if wait_quiet is None else wait_quiet)
            results["clients"] = m = measure(server.base_url + "/v1", model, concurrency, rounds)
        finally:
            server.stop()
    sdk, aio, ours = m["sdk"], m["sdk + aiohttp"], m["ours"]
    ratio = sdk["cpu_ms_per_request"] / ours["cpu_ms_per_request"]
    rows = [
        row(
            f"client CPU per request, {concurrency} in flight: SDK vs ours",
            sdk["cpu_ms_per_request"],
            ours["cpu_ms_per_request"],
            ratio,
            f">={GOAL}x",
            ratio >= GOAL and ours["sdk_fallbacks"] == 0,
            unit="ms",
        ),
        row(
            "client CPU per request: SDK with its aiohttp transport vs ours",
            aio["cpu_ms_per_request"],
            ours["cpu_ms_per_request"],
            aio["cpu_ms_per_request"] / ours["cpu_ms_per_request"],
            "(report)",
            None,
            unit="ms",
        ),
        row(
            f"wall per round of {concurrency} requests (8 tokens each): SDK vs ours",
            sdk["wall_ms_per_round"],
            ours["wall_ms_per_round"],
            sdk["wall_ms_per_round"] / ours["wall_ms_per_round"],
            "(report)",
            None,
            unit="ms",
        ),
    ]
    return finish(NAME, quick, results, t_start, [(f"rollout client ({'quick' if quick else 'full'})", rows)])


def main(argv=None) -> int:
    return main_for(run, __doc__, "16 in flight, 3 rounds (< 30 s)", argv)


if __name__ == "__main__":
    sys.exit(main())
