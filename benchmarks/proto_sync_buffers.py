"""Diagnostic (not a benchmark with goals): what bucketed weight sync would cost with persistent, pre-faulted
pack/receive buffers instead of a fresh `torch.empty(bucket)` per bucket (sender) and per sync (receiver).

    /work/main/.venv/bin/python benchmarks/proto_sync_buffers.py [--hidden 704 --layers 22]

The library is not modified: the server runs through this file (`--serve`), which swaps
`transfer.gloo.receive_buckets` for a variant that keeps its buffer between syncs, then starts the normal
server; in this process `transfer.gloo.send_buckets` is swapped the same way. Both variants move the same bytes
with the same bucket plan. Prints stock vs prototype seconds and GB/s, and raw gloo GB/s for reference.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import print_table, row, wait_for_quiet, write_results  # noqa: E402

_BUF: dict[str, torch.Tensor] = {}


def _buffer(key: str, nbytes: int) -> torch.Tensor:
    buf = _BUF.get(key)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        buf.fill_(0)  # fault the pages in once
        _BUF[key] = buf
    return buf[:nbytes]


def persistent_send_buckets(pg, buckets, tensors_by_name) -> int:
    from verifiers_rl.rl.inference.transfer.buckets import pack
    from verifiers_rl.rl.inference.transfer.gloo import broadcast

    sent = 0
    size = max((b.nbytes for b in buckets), default=0)
    for bucket in buckets:
        buf = pack(bucket, [tensors_by_name[m.name] for m in bucket.metas], out=_buffer("send", size)[: bucket.nbytes])
        broadcast(pg, buf)
        sent += bucket.nbytes
    return sent


def persistent_receive_buckets(pg, buckets, on_bucket) -> None:
    from verifiers_rl.rl.inference.transfer.buckets import unpack
    from verifiers_rl.rl.inference.transfer.gloo import broadcast

    buf = _buffer("recv", max((b.nbytes for b in buckets), default=0))
    for bucket in buckets:
        view = buf[: bucket.nbytes]
        broadcast(pg, view)
        on_bucket(unpack(bucket, view))


def patch(side: str) -> None:
    from verifiers_rl.rl.inference.transfer import gloo

    if side == "send":
        gloo.send_buckets = persistent_send_buckets
    else:
        gloo.receive_buckets = persistent_receive_buckets


def _server(model_dir: str, tmp: str, proto: bool):
    from verifiers_rl.rl.inference.launcher import InferenceServer

    class ProtoServer(InferenceServer):
        def command(self):
            cmd = super().command()
            return [cmd[0], os.path.abspath(__file__), "--serve", *cmd[3:]] if proto else cmd

    return ProtoServer(
        model_dir,
        engine="cpu",
        output_dir=os.path.join(tmp, "out"),
        startup_timeout=300,
        extra_args=["--max-model-len", "1024", "--max-num-seqs", "8", "--log-level", "warning"],
    )


def run(hidden: int = 704, layers: int = 22, repeats: int = 5) -> dict:
    import bench_sync

    from verifiers_rl.rl.inference.transfer import gloo
    from verifiers_rl.tiny import build_tiny_model, save_tiny_model

    stock_send = gloo.send_buckets
    out: dict = {"name": "proto_sync_buffers", "hidden": hidden, "layers": layers, "repeats": repeats}
    out["machine_before"] = wait_for_quiet(180)
    with tempfile.TemporaryDirectory(prefix="proto_sync_") as tmp:
        model_dir = str(save_tiny_model(os.path.join(tmp, "m"), hidden=hidden, layers=layers))
        model, _ = build_tiny_model(hidden=hidden, layers=layers)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        out["bytes"] = nbytes
        # Both servers up at once and the variants interleaved, so background load hits both alike.
        with _server(model_dir, tmp, False) as stock_client, _server(model_dir, tmp, True) as proto_client:
            stock_client.init_weight_transfer()
            proto_client.init_weight_transfer()

            def stock():
                return bench_sync.bucketed_sync(stock_client, model)

            def proto():
                gloo.send_buckets = persistent_send_buckets
                try:
                    return bench_sync.bucketed_sync(proto_client, model)
                finally:
                    gloo.send_buckets = stock_send

            out["stock"], out["persistent_buffers"] = bench_sync.measure_interleaved([stock, proto], repeats)
        for variant in ("stock", "persistent_buffers"):
            m = out[variant]
            m["gb_per_s"] = m["bytes"] / m["seconds"] / 1e9
            print(f"{variant}: {m['seconds'] * 1e3:.1f} ms ({m['gb_per_s']:.2f} GB/s) {m['all_seconds']}", flush=True)
        out["raw_gloo"] = bench_sync.raw_gloo_bandwidth(nbytes, repeats)
    raw, st, pr = out["raw_gloo"]["gb_per_s"], out["stock"], out["persistent_buffers"]
    rows = [
        row(
            f"bucketed sync {nbytes / 1e6:.0f} MB: stock vs persistent buffers",
            st["seconds"],
            pr["seconds"],
            st["seconds"] / pr["seconds"],
            "(info)",
            None,
            unit="s",
        ),
        row(
            "  as a fraction of raw gloo GB/s",
            st["gb_per_s"] / raw,
            pr["gb_per_s"] / raw,
            pr["gb_per_s"] / st["gb_per_s"],
            ">=50% (bench_sync goal)",
            pr["gb_per_s"] / raw >= 0.5,
            unit="of raw",
        ),
    ]
    out["rows"] = rows
    print_table(f"prototype: persistent transfer buffers (raw gloo {raw:.2f} GB/s; median of {repeats})", rows)
    print(f"results: {write_results(f'proto_sync_buffers_{hidden}x{layers}', out)}")
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--serve":  # server process: patch the receiver, then the stock entry point
        patch("recv")
        from verifiers_rl.rl.inference.server import main as server_main

        return server_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=704)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    run(args.hidden, args.layers, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
