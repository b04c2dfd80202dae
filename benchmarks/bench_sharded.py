"""Sharded training benchmark: DeepSpeed ZeRO-3 and FSDP2 against replicated DDP, 2 CPU processes each.

    .venv/bin/python benchmarks/bench_sharded.py [--quick]

For each layout the same RL run is launched as users launch it: `accelerate launch` with a ZeRO-3 or FSDP2 config
(as tests/e2e/test_sharded.py; `use_cpu`, 2 processes, no mixed precision) or plain multi-process DDP, running this
file with `--worker`: RLTrainer with full fine-tuning of a random Qwen3-shaped model (~100M parameters; `--quick`:
~10M, DDP and FSDP2 only) on `reverse-text`, its own CPU-engine server, `max_async_level = 0`, a weight sync
after every step.

- **sync seconds**: the trainer's `timing/sync_s` of each step (rank 0's sender clock: the export's gathers, bucket
  packing, checksums, the broadcast, the server's load and its checksum report), median over the steps after the
  first (warm-up: staging buffers, first gathers). Sharded layouts gather every parameter on every rank while
  rank 0 sends; DDP's rank 0 sends what it holds.
- **peak RSS per rank**: each rank resets its high-water mark (`/proc/self/clear_refs`, as bench_train.py does) once
  the trainer is set up (model loaded and wrapped, server started), and reads `VmHWM` when training ends: the
  training steps and syncs, optimizer state included (AdamW allocates it at the first step). The row is the
  larger rank's. Also reported: the same peak above the process's RSS before the model was loaded (imports:
  torch, transformers, DeepSpeed, verifiers), which sharding cannot shrink.

Both are reports (the goals of ≤ 1.3× and ≤ 0.6× DDP's went with issue 58: on 2 CPU processes at ~100M the ratio
follows DDP's own sync time, and sharded state is small next to each rank's interpreter; what sharding saves shows
on GPUs at sizes this machine cannot hold). The three layouts run one after another; compare only within one run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import arg_parser, finish, median, row, wait_for_quiet  # noqa: E402

from verifiers_rl.plan.ranks import LAYOUTS  # noqa: E402

NAME = "bench_sharded"
MODELS = {"full": ("~100M", 704, 22), "quick": ("~10M", 256, 16)}  # (label, hidden, layers) as bench_sync.py
# --quick (CI checks that it runs): the baseline and one sharded layout; tests/e2e/test_sharded.py runs both
QUICK_LAYOUTS = ("ddp", "fsdp2")
ACCELERATE = Path(__file__).resolve().parents[1] / "configs" / "accelerate"
# the shipped configs/accelerate/<layout>.yaml on 2 CPU processes, as tests/e2e/test_sharded.py runs them
ON_CPU = {"use_cpu": True, "num_processes": 2, "mixed_precision": "no"}
# DDP on CPU: accelerate's multi-process launcher (its `--cpu` would start one process), as tests/e2e/test_ddp.py
DDP_ARGS = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]


# ---------------------------------------------------------------------------------------- one rank (--worker)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    # "5" resets this process's VmHWM to its current RSS (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(model_dir: str, out: str, steps: int) -> None:
    import verifiers as vf
    from transformers import TrainerCallback

    from verifiers_rl.trainer import RLConfig, RLTrainer

    rank = int(os.environ.get("RANK", "0"))
    memory = {"rss_before_model_kib": _status_kib("VmRSS")}

    class PeakRSS(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # after the trainer's own hooks (server, sync)
            _reset_peak()
            memory["rss_at_train_begin_kib"] = _status_kib("VmRSS")

        def on_train_end(self, args, state, control, **kwargs):
            memory["peak_rss_kib"] = _status_kib("VmHWM")

    env = vf.load_environment("reverse-text", num_train_examples=64, num_eval_examples=4)
    args = RLConfig(
        output_dir=out,
        use_lora=False,
        rollouts_per_example=4,
        batch_size=8,
        micro_batch_size=4,
        max_steps=steps,
        max_tokens=8,
        max_seq_len=256,
        learning_rate=1e-6,
        use_cpu=True,
        seed=0,
        save_strategy="no",
        max_async_level=0,
        log_completions=False,
        server_mode="spawn",
    )
    trainer = RLTrainer(model=model_dir, env=env, args=args, callbacks=[PeakRSS()])
    try:
        trainer.train()
    finally:
        trainer.close()
    memory["export"] = type(trainer.weight_export()).__name__
    Path(out, f"memory-rank{rank}.json").write_text(json.dumps(memory))


# ---------------------------------------------------------------------------------------- the launcher's side


def launch(layout: str, model_dir: str, out: Path, steps: int, log) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    launcher = [sys.executable, "-m", "accelerate.commands.launch"]
    if layout == "ddp":
        launcher += DDP_ARGS
    else:
        config = out.parent / f"{layout}.yaml"
        config.write_text(yaml.safe_dump({**yaml.safe_load((ACCELERATE / f"{layout}.yaml").read_text()), **ON_CPU}))
        launcher += ["--config_file", str(config)]
    cmd = [*launcher, os.path.abspath(__file__), "--worker", model_dir, str(out), str(steps)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{layout} run failed ({r.returncode}): {r.stderr[-3000:]}")
    from verifiers_rl.export.reward_curve import read_metrics

    rows = [r for r in read_metrics(out) if "loss" in r]
    syncs = [r["timing/sync_s"] for r in rows if r["timing/sync_s"] > 0]  # 0: a step that trained nothing
    if not syncs:
        raise RuntimeError(f"{layout}: no step moved weights; nothing to time")
    ranks = [json.loads((out / f"memory-rank{i}.json").read_text()) for i in range(2)]
    res = {
        "seconds": time.perf_counter() - t0,
        "export": ranks[0]["export"],
        "sync_s_per_step": syncs,
        "sync_s": median(syncs[1:] or syncs),
        "ranks": ranks,
        "peak_rss_bytes": max(r["peak_rss_kib"] for r in ranks) << 10,
        "peak_above_imports_bytes": max(r["peak_rss_kib"] - r["rss_before_model_kib"] for r in ranks) << 10,
        "mismatch_kl": [r["mismatch_kl"] for r in rows],
    }
    log(
        f"{layout} ({res['export']}): sync {res['sync_s']:.3f} s (per step {[round(s, 3) for s in syncs]}), "
        f"peak RSS {res['peak_rss_bytes'] / 2**30:.2f} GiB, run {res['seconds']:.0f} s"
    )
    return res


def run(quick: bool = False, wait_quiet: float | None = None) -> dict:
    from verifiers_rl.tiny import build_tiny_model, save_tiny_model

    label, hidden, layers = MODELS["quick" if quick else "full"]
    steps = 2 if quick else 4
    results: dict = {"name": NAME, "quick": quick, "steps": steps, "layouts": {}}
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    results["machine_before"] = wait_for_quiet((0 if quick else 180) if wait_quiet is None else wait_quiet, log=log)
    with tempfile.TemporaryDirectory(prefix="bench_sharded_") as tmp:
        model_dir = str(save_tiny_model(Path(tmp) / "model", hidden=hidden, layers=layers))
        model, _ = build_tiny_model(hidden=hidden, layers=layers)
        params = sum(p.numel() for p in model.parameters())
        results["model"] = {"label": label, "hidden": hidden, "layers": layers, "params": params}
        del model
        log(f"model {label}: {params:,} parameters, full fine-tuning, {steps} steps per layout")
        for layout in QUICK_LAYOUTS if quick else LAYOUTS:
            results["layouts"][layout] = launch(layout, model_dir, Path(tmp) / layout, steps, log)
    rows, info = _rows(results, label, params, quick)
    title = f"sharded training ({'quick' if quick else 'full'}; {label}, 2 CPU processes per layout)"
    return finish(NAME, quick, results, t_start, [(title, rows), ("sharded training: diagnostics", info)])


def _rows(results: dict, label: str, params: int, quick: bool) -> tuple[list[dict], list[dict]]:
    ddp, rows, info = results["layouts"]["ddp"], [], []
    for layout, name in (("zero3", "ZeRO-3"), ("fsdp2", "FSDP2")):
        if layout not in results["layouts"]:
            continue
        res = results["layouts"][layout]
        ratio = res["sync_s"] / ddp["sync_s"]
        rows.append(
            row(
                f"sync {label} ({params / 1e6:.0f}M params): DDP (replicated) vs {name}",
                ddp["sync_s"],
                res["sync_s"],
                ratio,
                "(report)",
                None,
                unit="s",
            )
        )
        gib = 2**30
        ratio = res["peak_rss_bytes"] / ddp["peak_rss_bytes"]
        rows.append(
            row(
                f"peak RSS per rank, {label} full fine-tuning: DDP vs {name}",
                ddp["peak_rss_bytes"] / gib,
                res["peak_rss_bytes"] / gib,
                ratio,
                "(report)",
                None,
                unit="GiB",
            )
        )
        above = res["peak_above_imports_bytes"] / ddp["peak_above_imports_bytes"]
        info.append(
            row(
                f"peak RSS above the imports' RSS, per rank: DDP vs {name}",
                ddp["peak_above_imports_bytes"] / gib,
                res["peak_above_imports_bytes"] / gib,
                above,
                "(info)",
                None,
                unit="GiB",
            )
        )
    return rows, info


def main(argv=None) -> int:
    p = arg_parser(__doc__, "a ~10M model, 2 steps, DDP and FSDP2")
    p.add_argument("--worker", nargs=3, metavar=("MODEL_DIR", "OUT", "STEPS"), help="(internal) one rank's run")
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]))
        return 0
    return 0 if run(quick=args.quick, wait_quiet=args.wait_quiet)["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
