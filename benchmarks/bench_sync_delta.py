"""Send only what changed (sync/delta.py) vs today's full sync, after one real full fine-tuning step.

    .venv/bin/python benchmarks/bench_sync_delta.py [--quick]

A tiny Qwen3 model of ~100M parameters (float32 master weights, synced in bf16 as the trainer's merged stream
`policy_weights.merged_stream(model, bfloat16)`) takes one AdamW step at each learning rate; then, on one
CPU-engine server and one weight group, interleaved: the full sync of the stepped weights, and the delta sync of
the same weights against the pre-step ones the server was just given (untimed). Both are verified (the server's
read-back checksums). Rows: bytes sent and seconds, median of N repeats after a warm-up. `--quick`: a ~10M
model, two learning rates, fewer repeats.

An optimizer's first AdamW step moves every element by about the learning rate (m / sqrt(v) is +-1), so whether
an element's bf16 value changes depends on the learning rate against its magnitude: what these rows measure.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import arg_parser, finish, git_commit, median, row, sync_server, wait_for_quiet  # noqa: E402

NAME = "bench_sync_delta"
MODEL = ("~100M", 704, 22)  # (label, hidden, layers), as bench_sync's ~100M row
QUICK_MODEL = ("~10M", 256, 16)
LRS = (1e-6, 1e-5, 1e-4)
QUICK_LRS = (1e-5,)  # CI checks that it runs: one rate, one round after the warm-up


def stepped(model, initial: dict, lr: float) -> None:
    """`model` back to `initial`, then one AdamW step on a fixed random batch (a fresh optimizer)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(initial[n])
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ids = torch.randint(3, 250, (2, 32), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def one_round(client, model, before: list) -> tuple[dict, dict]:
    """A full sync of `model`'s bf16 weights, then a delta sync of them against `before` (sent untimed first)."""
    from verifiers_rl.sync.delta import Changes
    from verifiers_rl.sync.policy_weights import merged_stream

    sender = client.sender
    version = int(client.weight_version())
    sender.changes = None  # today's path, untouched
    full = client.update_weights(merged_stream(model, torch.bfloat16), version=version + 1)
    sender.changes = Changes()
    client.update_weights(before, version=version + 2)  # whole: the snapshot is recorded
    t0 = time.perf_counter()
    change = client.update_weights(merged_stream(model, torch.bfloat16), version=version + 3)
    wall = time.perf_counter() - t0
    sender.changes = None
    return {"seconds": full.seconds, "bytes": full.bytes}, {"seconds": wall, "bytes": change.bytes}


def measure(client, model, before: list, repeats: int) -> tuple[dict, dict]:
    one_round(client, model, before)  # warm-up
    fulls, deltas = [], []
    for _ in range(repeats):
        f, d = one_round(client, model, before)
        fulls.append(f)
        deltas.append(d)

    def summary(xs):
        secs = [x["seconds"] for x in xs]
        return {"seconds": median(secs), "all_seconds": secs, "bytes": xs[-1]["bytes"]}

    return summary(fulls), summary(deltas)


def changed_fraction(model, before: list) -> float:
    from verifiers_rl.sync.delta import changed_mask
    from verifiers_rl.sync.policy_weights import merged_stream

    old = dict(before)
    changed = total = 0
    for name, t in merged_stream(model, torch.bfloat16):
        mask = changed_mask(old[name], t)
        changed, total = changed + int(mask.sum()), total + mask.numel()
    return changed / total


def run(quick: bool = False, wait_quiet: float | None = None) -> dict:
    from verifiers_rl.sync.policy_weights import merged_stream
    from verifiers_rl.tiny import build_tiny_model, save_tiny_model

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    label, hidden, layers = QUICK_MODEL if quick else MODEL
    lrs, repeats = (QUICK_LRS, 1) if quick else (LRS, 3)
    results: dict = {"name": NAME, "quick": quick, "repeats": repeats, "model": label, "lrs": {}}
    results["commit"] = git_commit()
    results["started_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    results["machine_before"] = wait_for_quiet((0 if quick else 180) if wait_quiet is None else wait_quiet, log=log)
    rows, info_rows = [], []
    with tempfile.TemporaryDirectory(prefix="bench_sync_delta_") as tmp:
        model_dir = save_tiny_model(os.path.join(tmp, "model"), hidden=hidden, layers=layers)
        model, _ = build_tiny_model(hidden=hidden, layers=layers)
        n_params = sum(p.numel() for p in model.parameters())
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        before = [(n, t.clone()) for n, t in merged_stream(model, torch.bfloat16)]
        results.update(params=n_params, wire_bytes=sum(t.numel() * 2 for _, t in before))
        server = sync_server(model_dir, os.path.join(tmp, "out"))
        with server as client:
            client.init_weight_transfer(server_pauses=True, changed_only=True)
            for lr in lrs:
                stepped(model, initial, lr)
                frac = changed_fraction(model, before)
                full, change = measure(client, model, before, repeats)
                results["lrs"][str(lr)] = {"changed_fraction": frac, "full": full, "delta": change}
                log(
                    f"lr={lr:g}: {frac:.2%} of bf16 elements changed; full {full['bytes'] / 1e6:.1f} MB "
                    f"{full['seconds'] * 1e3:.0f} ms, delta {change['bytes'] / 1e6:.2f} MB "
                    f"{change['seconds'] * 1e3:.0f} ms"
                )
                what = f"{label} ({n_params / 1e6:.0f}M) after one AdamW step at lr={lr:g} ({frac:.1%} changed)"
                ratio = full["bytes"] / change["bytes"] if change["bytes"] else float("inf")
                rows.append(row(f"bytes sent, {what}: full vs changed only", full["bytes"], change["bytes"],
                                ratio, "(report)", None, unit="B"))  # fmt: skip
                rows.append(row(f"sync time, {what}: full vs changed only", full["seconds"], change["seconds"],
                                full["seconds"] / change["seconds"], "(report)", None, unit="s"))  # fmt: skip
    results["info_rows"] = info_rows
    title = f"send only what changed ({'quick' if quick else 'full'}; median of {repeats} after a warm-up)"
    return finish(NAME, quick, results, t_start, [(title, rows)])


def main(argv=None) -> int:
    p = arg_parser(__doc__, "a ~10M model, two learning rates, fewer repeats")
    args = p.parse_args(argv)
    res = run(quick=args.quick, wait_quiet=args.wait_quiet)
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
