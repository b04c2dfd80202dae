"""Sharded export gather: the libraries' own gathers against the hand-written path to rank 0, 2 CPU processes.

    .venv/bin/python benchmarks/bench_gather.py [--quick] [--repeats N]

For each layout (FSDP2: `fully_shard` on a 2-rank CPU mesh; ZeRO-3: `deepspeed.zero.Init`) two gloo processes
hold a random Qwen3-shaped model in shards and produce its merged sync stream (`weight_export(model).stream`, as a
sync does, inside `RankZeroLeads.run`: rank 0 opens each walk to the other rank and receives the tensors), without
a server: what is timed is the gather alone, rank 0's clock between two barriers. The paths alternate in each
repeat (order flipped every repeat); the first repeat also checks that both give the model's own weights. The row
is the median library time over the median hand time: the hand path is kept only where it is >= 1.3x faster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import arg_parser, finish, git_commit, median, row  # noqa: E402

NAME = "bench_gather"
MODELS = {"full": ("~100M", 704, 22), "quick": ("~10M", 256, 16)}
KEEP_HAND = 1.3


def _shard(layout: str, hidden: int, layers: int):
    from verifiers_rl.tiny import build_tiny_model

    if layout == "zero3":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        model, _ = build_tiny_model(hidden=hidden, layers=layers)
        cfg = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
        deepspeed.zero.Init(module=model, config_dict_or_path=cfg)  # partitions the built model in place
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, _ = build_tiny_model(hidden=hidden, layers=layers)
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def worker(layout: str, hidden: int, layers: int, repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from verifiers_rl.sync.export import weight_export
    from verifiers_rl.tiny import build_tiny_model
    from verifiers_rl.trainer.rank_zero import RankZeroLeads

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    reference = build_tiny_model(hidden=hidden, layers=layers)[0].state_dict() if rank == 0 else None
    model = _shard(layout, hidden, layers)
    leads = RankZeroLeads(lambda: export)
    export = weight_export(model, leads=leads)
    times: dict[str, list[float]] = {"hand": [], "library": []}
    first: dict[str, dict] = {}
    for rep in range(repeats + 1):  # the first: warm-up (rank 0's ring, first gathers) and the correctness check
        for path in ("hand", "library") if rep % 2 else ("library", "hand"):
            export.hand_gather = path == "hand"
            dist.barrier()
            t0 = time.perf_counter()
            got = {}
            leads.run(
                lambda got=got, c=rep == 0: got.update((n, t.clone() if c else t) for n, t in export.stream("merged"))
            )
            dist.barrier()
            if rep:
                times[path].append(time.perf_counter() - t0)
            else:
                first[path] = got
            del got
    check = {}
    if rank == 0:
        hand, lib = first["hand"], first["library"]
        assert hand and hand.keys() == lib.keys() and all(torch.equal(hand[n], lib[n]) for n in hand)
        check["equal_to_unsharded"] = all(torch.equal(t, reference[n]) for n, t in lib.items())
        check["tensors"] = len(lib)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"layout": type(export).__name__, "times": times, **check}, f)
    dist.destroy_process_group()


def launch(layout: str, hidden: int, layers: int, repeats: int, tmp: str, log) -> dict:
    out = os.path.join(tmp, f"{layout}.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           os.path.abspath(__file__), "--worker", layout, str(hidden), str(layers), str(repeats), out]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{layout} failed ({r.returncode}): {r.stderr[-3000:]}")
    res = json.loads(open(out).read())
    res["hand_s"], res["library_s"] = median(res["times"]["hand"]), median(res["times"]["library"])
    log(f"{layout}: hand {res['times']['hand']}, library {res['times']['library']}")
    return res


def run(quick: bool, repeats: int) -> dict:
    import tempfile

    label, hidden, layers = MODELS["quick" if quick else "full"]
    t_start = time.perf_counter()
    results: dict = {"name": NAME, "quick": quick, "repeats": repeats, "commit": git_commit(), "layouts": {}}
    results["model"] = {"label": label, "hidden": hidden, "layers": layers}

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench_gather_") as tmp:
        for layout in ("fsdp2", "zero3"):
            results["layouts"][layout] = launch(layout, hidden, layers, repeats, tmp, log)
    rows = []
    for layout, res in results["layouts"].items():
        ratio = res["library_s"] / res["hand_s"]
        rows.append(
            row(
                f"merged stream gather {label}, {layout}: hand vs library",
                res["hand_s"],
                res["library_s"],
                ratio,
                f"keep hand if >={KEEP_HAND}x",
                None,
                unit="s",
            )  # fmt: skip
        )
    return finish(NAME, quick, results, t_start, [("sharded gather, 2 CPU processes over gloo", rows)])


def main(argv=None) -> int:
    p = arg_parser(__doc__, "a ~10M model")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", nargs=5, help="(internal) one rank")
    args = p.parse_args(argv)
    if args.worker:
        layout, hidden, layers, repeats, out = args.worker
        worker(layout, int(hidden), int(layers), int(repeats), out)
        return 0
    run(args.quick, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
