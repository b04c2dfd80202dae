"""Weight-sync benchmark: bucketed sync (ours) vs one request + one broadcast per tensor (the old design),
raw gloo bandwidth between two local processes, and adapter vs merged sync of a LoRA model.

    [VF_VLLM_PYTHON=<vLLM venv python>] .venv/bin/python benchmarks/bench_sync.py [--quick]

Every sync goes trainer -> a running CPU-engine server (`InferenceServer(engine="cpu")`) on this machine as the
trainer syncs into it: one request per sync, the buckets through shared memory (sync/transport/shm.py; an info row
times the same sync with every byte on loopback gloo, which the per-tensor baseline uses too), and verified
(every rank's checksums of what it loaded; an info row times the same sync without);
adapter vs merged (`_adapter_sync.py`) also runs against real vLLM when VF_VLLM_PYTHON is set, for the tiny
model and a random model of Qwen3-0.6B's shape (2.4 GB; peak ~10 GB with the server). Times are medians of N
repeats after one warm-up sync. `--quick` drops the ~100M and 0.6B models and uses fewer repeats.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _adapter_sync  # noqa: E402
import torch  # noqa: E402
from _common import arg_parser, finish, median, row, sync_server, wait_for_quiet  # noqa: E402

NAME = "bench_sync"

# (label, hidden, layers): Qwen3 tiny kit, 11 tensors per layer + 3 (embed, final norm, untied lm_head).
MODELS = [
    ("~1M", 128, 4),
    ("~10M", 256, 16),
    ("~100M", 704, 22),
]
ADAPTER_MODELS = ("tiny", "qwen3-0.6b-shape")  # adapter vs merged LoRA sync (--quick: tiny only)
BANDWIDTH_GOAL = 0.8  # bucketed GB/s vs raw gloo GB/s at ~100M (issue 24; it was 50 %)


# ---------------------------------------------------------------------------------------- syncs


def on(client, model, shm: bool, bucket_bytes: int | None = None) -> bool:
    """Sync as the trainer does into our CPU engine (one request per sync; with `shm`, buckets through shared
    memory, sync/transport/shm.py), re-joining the group only when the transport or bucket size changes, then syncing
    once untimed: a trainer keeps its group for the whole run, so the first touch of a new group's buffers (the
    shared file's pages on both sides, 2 x 64 MB) is not what a sync costs."""
    sender = client.sender
    want = bucket_bytes or (sender.bucket_bytes if sender is not None else None)
    if sender is None or sender.shared_memory != shm or sender.bucket_bytes != want:
        client.init_weight_transfer(server_pauses=True, shared_memory=shm, bucket_bytes=want)
        if shm and not client.sender.shared_memory:
            raise RuntimeError("the server declined shared-memory buckets (no room in /dev/shm?)")
        client.update_weights(model.named_parameters(), version=_next_version(client))
    return True


def _next_version(client) -> int:
    return int(client.weight_version()) + 1


def bucketed_sync(client, model) -> tuple[float, int]:
    stats = client.update_weights(model.named_parameters(), version=_next_version(client))
    return stats.seconds, stats.bytes


def unverified_sync(client, model) -> tuple[float, int]:
    """`bucketed_sync` without its verification (sync/verify.py): no report id, so the server reads nothing
    back and reports nothing, and no checksums on the trainer's side; the same one request and buckets otherwise
    (`GlooSender.send` for a server that pauses itself), timed as the sender times itself. What the checksums cost
    is the difference."""
    from verifiers_rl.sync.buckets import UpdateInfo, plan_buckets
    from verifiers_rl.sync.stream import as_stream
    from verifiers_rl.sync.transport import gloo

    sender, version = client.sender, _next_version(client)
    t0 = time.perf_counter()
    stream = as_stream(model.named_parameters())
    buckets = plan_buckets(stream.metas, sender.bucket_bytes)
    body = {"update_info": UpdateInfo.from_metas(stream.metas).to_dict(), "weight_version": str(version)}
    pending = gloo.Background(lambda: sender.post("/update_weights", body))
    sent = gloo.send_buckets(sender.group, buckets, stream)
    pending.result()
    return time.perf_counter() - t0, sent


def per_tensor_sync(client, model, pool: ThreadPoolExecutor) -> tuple[float, int]:
    """The old design, on the same server and group: pause, start, then for every tensor one /update_weights
    request describing that tensor alone while the trainer broadcasts that tensor alone; then finish, reset the
    prefix cache and resume. Tensors are broadcast in place (no packing copy), and the control requests reuse a
    thread pool and keep-alive connection, so this baseline is, if anything, flattered."""
    from verifiers_rl.sync.buckets import TensorMeta, UpdateInfo
    from verifiers_rl.sync.transport import gloo

    if client.sender is None:
        raise RuntimeError("init_weight_transfer() first")
    group = client.sender.group
    t0 = time.perf_counter()
    sent = 0
    version = _next_version(client)
    with client.paused("keep"):
        client.post("/start_weight_update")
        for name, p in model.named_parameters():
            t = p.detach().contiguous()
            info = UpdateInfo.from_metas([TensorMeta(name, t.dtype, tuple(t.shape))]).to_dict()
            # the server plans this one tensor with its bucket size: a tensor travels alone at >= its size
            fut = pool.submit(client.post, "/update_weights", {"update_info": info})
            gloo.broadcast(group, t.reshape(-1).view(torch.uint8))
            fut.result()
            sent += t.numel() * t.element_size()
        client.post("/finish_weight_update", {"weight_version": str(version)})
        client.reset_prefix_cache()
    return time.perf_counter() - t0, sent


def measure(fn, repeats: int) -> dict:
    return measure_interleaved([fn], repeats)[0]


def measure_interleaved(fns, repeats: int) -> list[dict]:
    """One warm-up each, then `repeats` rounds of a, b, ... in turn: a background load on this small machine
    then hits every variant alike instead of skewing whichever ran during it."""
    for fn in fns:
        fn()
    secs = [[] for _ in fns]
    nbytes = [0] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            s, nbytes[i] = fn()
            secs[i].append(s)
    return [{"seconds": median(s), "all_seconds": s, "bytes": b} for s, b in zip(secs, nbytes)]


# ---------------------------------------------------------------------------------------- raw gloo


def _gloo_peer(host: str, port: int, nbytes: int, reps: int, fresh: bool = False) -> None:
    """Rank 1 of the raw-bandwidth test (runs in a child process). `fresh`: a new receive buffer per broadcast,
    as the current receiver allocates one per sync (its pages are faulted in while the data arrives)."""
    from verifiers_rl.sync.transport import gloo

    g = gloo.create_group(host, port, 1, 2, timeout_s=120)
    buf = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    tick = torch.zeros(1, dtype=torch.uint8)
    for _ in range(reps):
        if fresh:
            del buf
            buf = torch.empty(nbytes, dtype=torch.uint8)
        gloo.broadcast(g, tick, root=0)  # start together
        gloo.broadcast(g, buf, root=0)
        gloo.broadcast(g, tick, root=1)  # ack: the sender stops its clock on this


def raw_gloo_bandwidth(nbytes: int, repeats: int, fresh: bool = False) -> dict:
    """One flat `nbytes` broadcast between two local processes; the clock covers the broadcast and a 1-byte
    ack from the receiver (so it measures delivery, not only the sender's buffer hand-off)."""
    from verifiers_rl.config.net import free_port
    from verifiers_rl.sync.transport import gloo

    host, port = "127.0.0.1", free_port()
    reps = repeats + 1
    peer = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--gloo-peer", host, str(port), str(nbytes), str(reps)]
        + (["--fresh"] if fresh else []),
        stdin=subprocess.DEVNULL,
    )
    try:
        g = gloo.create_group(host, port, 0, 2, timeout_s=120)
        buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        tick = torch.zeros(1, dtype=torch.uint8)
        secs = []
        for _ in range(reps):
            gloo.broadcast(g, tick, root=0)
            t0 = time.perf_counter()
            gloo.broadcast(g, buf, root=0)
            gloo.broadcast(g, tick, root=1)
            secs.append(time.perf_counter() - t0)
        peer.wait(60)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(10)
    secs = secs[1:]  # first is warm-up
    s = median(secs)
    return {"bytes": nbytes, "seconds": s, "all_seconds": secs, "gb_per_s": nbytes / s / 1e9}


# ---------------------------------------------------------------------------------------- run


def run(quick: bool = False, wait_quiet: float | None = None) -> dict:
    from verifiers_rl.models import weight_bytes
    from verifiers_rl.tiny import build_tiny_model, save_tiny_model

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    models = MODELS[:2] if quick else MODELS
    repeats = 3 if quick else 5
    sweep = [] if quick else [16 << 20, 64 << 20]  # extra bucket sizes tried on the biggest model
    results: dict = {"name": NAME, "quick": quick, "repeats": repeats, "models": {}}
    rows, info_rows = [], []
    t_start = time.perf_counter()
    pool = ThreadPoolExecutor(1)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    results["machine_before"] = wait_for_quiet((0 if quick else 180) if wait_quiet is None else wait_quiet, log=log)
    with tempfile.TemporaryDirectory(prefix="bench_sync_") as tmp:
        for i, (label, hidden, layers) in enumerate(models):
            model_dir = save_tiny_model(os.path.join(tmp, f"m{hidden}x{layers}"), hidden=hidden, layers=layers)
            model, _ = build_tiny_model(hidden=hidden, layers=layers)
            n_params = sum(p.numel() for p in model.parameters())
            n_tensors = sum(1 for _ in model.parameters())
            nbytes = weight_bytes(model)
            is_last = i == len(models) - 1
            server = sync_server(model_dir, os.path.join(tmp, "out"))
            info = {"hidden": hidden, "layers": layers, "params": n_params, "tensors": n_tensors, "bytes": nbytes}
            with server as client:
                on(client, model, shm=True)  # the default bucket size (DEFAULT_BUCKET_BYTES)
                info["bucket_bytes"], info["shared_memory"] = client.bucket_bytes, client.sender.shared_memory
                ours, base, unverified, over_gloo = measure_interleaved(
                    [
                        lambda m=model: on(client, m, shm=True) and bucketed_sync(client, m),
                        lambda m=model: on(client, m, shm=False) and per_tensor_sync(client, m, pool),
                        lambda m=model: on(client, m, shm=True) and unverified_sync(client, m),
                        lambda m=model: on(client, m, shm=False) and bucketed_sync(client, m),
                    ],
                    repeats,
                )
                info["bucketed"], info["per_tensor"], info["unverified"] = ours, base, unverified
                info["bucketed_over_gloo"] = over_gloo
                if is_last and sweep:
                    info["bucket_sweep"] = {}
                    for bb in sweep:
                        on(client, model, shm=True, bucket_bytes=bb)
                        info["bucket_sweep"][bb] = measure(lambda m=model: bucketed_sync(client, m), repeats)
            sp = base["seconds"] / ours["seconds"]
            info.update(
                speedup=sp,
                bucketed_gb_per_s=ours["bytes"] / ours["seconds"] / 1e9,
                per_tensor_gb_per_s=base["bytes"] / base["seconds"] / 1e9,
            )
            results["models"][label] = info
            info_rows.append(
                row(
                    f"bucketed {label}: without vs with checksums (what verifying a sync costs)",
                    unverified["seconds"],
                    ours["seconds"],
                    ours["seconds"] / unverified["seconds"],
                    "(info)",
                    None,
                    unit="s",
                )
            )
            rows.append(  # a report: the 10x goal went with issue 58 (the baseline is our own, also faster, path)
                row(
                    f"sync {label} ({n_params / 1e6:.2f}M params, {n_tensors} tensors, {nbytes / 1e6:.0f} MB)",
                    base["seconds"],
                    ours["seconds"],
                    sp,
                    "(report)",
                    None,
                    unit="s",
                )
            )
            log(
                f"{label}: {n_params:,} params, {n_tensors} tensors, {nbytes / 1e6:.1f} MB; bucketed "
                f"{ours['seconds'] * 1e3:.1f} ms, per-tensor {base['seconds'] * 1e3:.1f} ms ({sp:.1f}x)"
            )
            del model
        label = models[-1][0]
        biggest = results["models"][label]
        results["raw_gloo"] = raw = raw_gloo_bandwidth(biggest["bytes"], repeats)
        results["raw_gloo_fresh_recv"] = raw_fresh = raw_gloo_bandwidth(biggest["bytes"], repeats, fresh=True)
        log(
            f"raw gloo {raw['gb_per_s']:.2f} GB/s; "
            f"with a fresh receive buffer each time {raw_fresh['gb_per_s']:.2f} GB/s"
        )
        bw, mb = biggest["bucketed_gb_per_s"], biggest["bytes"] / 1e6
        rows.append(
            row(
                f"bandwidth {label} ({mb:.0f} MB): raw gloo vs our sync (buckets through shared memory)",
                raw["gb_per_s"],
                bw,
                bw / raw["gb_per_s"],
                f">={BANDWIDTH_GOAL:.0%} of raw" if not quick else "(report)",
                (bw / raw["gb_per_s"] >= BANDWIDTH_GOAL) if not quick else None,
                unit="GB/s",
            )
        )
        gloo_bw = biggest["bucketed_over_gloo"]["bytes"] / biggest["bucketed_over_gloo"]["seconds"] / 1e9
        info_rows.append(
            row(
                f"bandwidth {label}: raw gloo vs our sync with shared memory off (every byte on gloo)",
                raw["gb_per_s"],
                gloo_bw,
                gloo_bw / raw["gb_per_s"],
                "(info)",
                None,
                unit="GB/s",
            )
        )
        # informational: what the receiver's per-sync buffer allocation and the bucket size cost
        info_rows.append(
            row(
                f"raw gloo {mb:.0f} MB: reused vs fresh receive buffer",
                raw["gb_per_s"],
                raw_fresh["gb_per_s"],
                raw_fresh["gb_per_s"] / raw["gb_per_s"],
                "(info)",
                None,
                unit="GB/s",
            )
        )
        for bb, m in biggest.get("bucket_sweep", {}).items():
            info_rows.append(
                row(
                    f"bucketed {label}: default {biggest['bucket_bytes'] >> 20} MiB vs {bb >> 20} MiB buckets",
                    biggest["bucketed"]["seconds"],
                    m["seconds"],
                    biggest["bucketed"]["seconds"] / m["seconds"],
                    "(info)",
                    None,
                    unit="s",
                    gb_per_s=m["bytes"] / m["seconds"] / 1e9,
                )
            )
    pool.shutdown()
    # LoRA: adapter vs merged sync, per engine (vLLM too when VF_VLLM_PYTHON names its venv)
    engines = ["cpu"] + (["vllm"] if os.environ.get("VF_VLLM_PYTHON") else [])
    results["adapter_vs_merged"] = {}
    for label in ADAPTER_MODELS[:1] if quick else ADAPTER_MODELS:
        res = _adapter_sync.compare(label, engines, repeats, measure_interleaved, log)
        results["adapter_vs_merged"][label] = res
        rows += _adapter_sync.rows(label, res, row)
    results["rows"] = rows
    results["info_rows"] = info_rows
    title = f"weight sync ({'quick' if quick else 'full'}; median of {repeats} after a warm-up)"
    return finish(NAME, quick, results, t_start, [(title, rows), ("weight sync: diagnostics", info_rows)])


def main(argv=None) -> int:
    p = arg_parser(__doc__, "drop the ~100M model, fewer repeats (< 60 s)")
    p.add_argument("--gloo-peer", nargs=4, metavar=("HOST", "PORT", "NBYTES", "REPS"), help=argparse.SUPPRESS)
    p.add_argument("--fresh", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.gloo_peer:
        host, port, nbytes, reps = args.gloo_peer
        _gloo_peer(host, int(port), int(nbytes), int(reps), fresh=args.fresh)
        return 0
    res = run(quick=args.quick, wait_quiet=args.wait_quiet)
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
