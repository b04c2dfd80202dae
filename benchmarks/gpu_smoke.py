"""GPU smoke test: run every GPU layout `vf-rl` plans, end to end, on a machine with GPUs and vLLM, and print
what was checked (docs/gpu-status.md says which paths have run on a GPU so far).

    python benchmarks/gpu_smoke.py [--model Qwen/Qwen3-0.6B] [--steps 3] [--only NAME]
    python benchmarks/gpu_smoke.py --dry-run [--gpus 2]       # any machine: the plans, checked, nothing started

Each layout gets a `reverse-text` config of `--steps` steps at max_async_level = 0 (so every batch is sampled with
the weights of the step before it). Checks per layout: the plan's processes agree (the same checks as
tests/unit/test_layouts.py), `vf-rl` exits 0, one metrics row per step, each step's batch was sampled with the
version synced after the step before (`policy_version`), the sampler and the trainer agree after every sync
(`mismatch_kl` < 1e-3), and no process outlived the run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

# name: (GPUs needed, [inference] gpus, [trainer] gpus, [trainer.args])
LAYOUTS = {
    "1gpu-lora-adapter": (1, 0, 1, {}),
    "1gpu-full-gloo": (1, 0, 1, {"use_lora": False, "learning_rate": 1e-6}),
    "2gpu-lora-nccl": (2, 1, 1, {}),
    "2gpu-full-nccl": (2, 1, 1, {"use_lora": False, "learning_rate": 1e-6}),
    "2gpu-shared-2trainers-lora": (2, 0, 2, {}),
}


def write_config(root: Path, name: str, model: str, steps: int) -> Path:
    _, inference, trainer, args = LAYOUTS[name]
    args = {
        "max_steps": steps,
        "batch_size": 16,
        "rollouts_per_example": 4,
        "micro_batch_size": 4,
        "max_tokens": 32,
        "max_seq_len": 256,
        "max_async_level": 0,
        "learning_rate": 1e-5,
        "save_strategy": "no",
        "bf16": True,
        **args,
    }
    lines = [
        f'model = "{model}"',
        f'output_dir = "{root / name}"',
        '[env]\nid = "reverse-text"',
        f"[inference]\ngpus = {inference}",
        "[inference.args]\nenforce_eager = true\ngpu_memory_utilization = 0.3" if inference else "",
        f"[trainer]\ngpus = {trainer}",
        "[trainer.args]",
        *(f"{k} = {json.dumps(v)}" for k, v in args.items()),
    ]
    path = root / f"{name}.toml"
    path.write_text("\n".join(line for line in lines if line) + "\n")
    return path


def check_plan(path: Path, gpus: int) -> list[tuple[str, bool]]:
    """The planned processes, read back as tests/unit/test_layouts.py reads them."""
    import tomllib

    from verifiers_rl.rl.plan.run import probe_machine
    from verifiers_rl.scripts.rl_plan import build_plan, trainer_env
    from verifiers_rl.scripts.toml_config import validate

    cfg = validate(tomllib.loads(path.read_text()), "vf-rl")
    plan = build_plan(cfg, str(path), [], probe_machine(gpus, 80), dry_run=True)
    server, env = plan.server.command(), trainer_env(plan, "token")
    backend = server[server.index("--weight-transfer-backend") + 1] if "--weight-transfer-backend" in server else None
    server_devs, trainer_devs = set(plan.gpus.inference), set(plan.gpus.trainer)
    return [
        (f"server backend {backend} = the plan's {plan.serving.server_weight_backend}",
         backend == plan.serving.server_weight_backend),
        (f"trainer in its own process(es) on CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}",
         bool(plan.trainer_cmd) and env["CUDA_VISIBLE_DEVICES"] == plan.visible(plan.gpus.trainer)),
        ("no NCCL rank on a server GPU",
         plan.serving.sync_backend != "nccl" or not server_devs & trainer_devs),
        (f"adapter flags iff adapter sync ({plan.serving.lora_sync})",
         ("--enable-lora" in server) == (plan.serving.lora_sync == "adapter")),
    ]  # fmt: skip


def check_run(path: Path, steps: int, gpus: int, timeout: float) -> list[tuple[str, bool]]:
    from procs import survivors

    from verifiers_rl.rl.trainer.callbacks import read_metrics

    out_dir = Path(tomllib_load(path)["output_dir"])
    t0 = time.monotonic()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(gpus))}  # the layout's GPUs
    proc = subprocess.Popen([sys.executable, "-m", "verifiers_rl.scripts.rl", "@", str(path)], cwd=ROOT, env=env)
    code = proc.wait(timeout)
    rows = read_metrics(out_dir)
    train = [r for r in rows if "policy_version" in r]
    versions = [int(r["policy_version"]) for r in train]
    kl = max((abs(r.get("mismatch_kl", 0.0)) for r in train), default=float("nan"))
    return [
        (f"vf-rl exited {code} after {time.monotonic() - t0:.0f}s", code == 0),
        (f"{len(train)} metric rows for {steps} steps", len(train) == steps),
        (f"batches sampled with versions {versions} (each the version synced after the step before)",
         versions == list(range(steps))),
        (f"sampler/trainer agreement: max mismatch_kl {kl:.2e} < 1e-3", kl < 1e-3),
        ("no process outlived the run", not survivors(proc.pid)),
    ]  # fmt: skip


def tomllib_load(path: Path) -> dict:
    import tomllib

    return tomllib.loads(path.read_text())


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="Qwen/Qwen3-0.6B")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--only", choices=sorted(LAYOUTS), action="append")
    p.add_argument("--dry-run", action="store_true", help="check the plans only (any machine)")
    p.add_argument("--gpus", type=int, default=None, help="with --dry-run: plan for this many GPUs")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per layout")
    args = p.parse_args()
    gpus = args.gpus if args.gpus is not None else (8 if args.dry_run else visible_gpus())
    if not args.dry_run and not gpus:
        print("gpu_smoke: no CUDA device visible; run with --dry-run to check the plans only", file=sys.stderr)
        return 2
    failed = 0
    with tempfile.TemporaryDirectory(prefix="gpu_smoke_") as tmp:
        for name in args.only or LAYOUTS:
            need = LAYOUTS[name][0]
            if need > gpus:
                print(f"[skip] {name}: needs {need} GPUs, {gpus} here")
                continue
            path = write_config(Path(tmp), name, args.model, args.steps)
            checks = check_plan(path, need)
            if not args.dry_run:
                checks += check_run(path, args.steps, need, args.timeout)
            for what, ok in checks:
                print(f"[{'ok' if ok else 'FAIL'}] {name}: {what}")
                failed += not ok
    print(f"gpu_smoke: {failed} check(s) failed" if failed else "gpu_smoke: every check passed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
