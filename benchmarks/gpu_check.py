"""The GPU check: the trainer on one CUDA GPU against our CPU inference engine, with checks that fail when a weight
sync did not land, and the memory planner against the GPU's own count. Needs one GPU, no network, no vLLM; under
10 minutes. `--cpu` runs the same stages on the CPU with small shapes (CI does, to prove the script runs).

    python benchmarks/gpu_check.py [--out DIR] [--steps 3] [--budget 540] [--only STAGE]   # one CUDA GPU
    python benchmarks/gpu_check.py --cpu                                                   # any machine
    python benchmarks/gpu_check.py --cpu --break-sync --only lora-bf16                     # the sync checks fail

Stages, each in a worker process of its own session (process group), killed with every process it started at
min(--stage-timeout, what is left of --budget less the cleanup after a kill). The budget counts from --started,
which gpu_check_device.sh sets to its own start: the install and every wait are inside it, so the whole command
ends by then (540 s of the lent machine's 600 s a command):

    lora-bf16    RLTrainer.train() (server_mode="spawn", server_engine="cpu", gloo sync, max_async_level=0) on the
                 tiny offline model and the repo's reverse-text environment: LoRA, merged sync, bf16 = true
    full-bf16    the same, full fine-tuning: float32 master weights (models.training_kwargs), bf16 compute
    full-bf16-changes  the same with sync_changed_only: every sync after the first is a diff against the
                 last-sent copy, computed on the trainer's device (sync/delta.py)
    memory-lora  forward/backward/AdamW of the Qwen3-0.6B shape (memory.KNOWN["qwen3-0.6b"], random weights), two
    memory-full  packed micro-batches of 4 x 1024 tokens a step: torch.cuda.max_memory_allocated vs
                 plan.memory.rank_parts (less the CUDA context)

Checks, one `[ok]` / `[FAIL]` / `[skip]` line each. Training stages: train() returned; the parameters are on cuda
and train in float32 (not with --cpu); (a) after every step the server's own `/weight_info` version equals the
step; (b) the server's seeded logprobs of a fixed prompt moved over the run (a large learning rate) and
agree with the trainer's own logprobs of the same tokens after every sync; nothing the stage started outlives it.
Memory stages: the estimate is within +-15 % of the measured peak (on CUDA only). `--break-sync` makes every sync
after the first a no-op (no bytes, no version), so (a) and (b) must fail. Writes gpu_check.json (device, versions,
per stage: record and checks) to --out after every stage; exits 1 when a check failed.

On a lent machine (no network) what its image lacks travel as wheels: gpu_wheels.py builds them here,
gpu_check_device.sh installs them there and runs this script from the checkout (no wheel of this project: what
runs is the working tree that travelled, edits made after the wheels were built included). `[warn] preflight:`
lines name requirements the installed packages do not meet.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV_DIR = ROOT / "environments" / "reverse_text"  # the reverse-text environment, importable without installing it


def checkout_first(entries: list[str]) -> list[str]:
    """`entries` (sys.path, or PYTHONPATH's) with the checkout first: its verifiers_rl, the one package at the
    repository's root (tests/unit/test_gpu_check_budget.py), wins over any installed copy, so what runs is what
    is checked out, not a wheel built earlier (issue 54). The rest of the repository is appended, never before an
    installed package (tests/ is here for procs.py)."""
    rest = [p for p in entries if p != str(ROOT)]
    extra = [p for p in (str(ENV_DIR), str(ROOT / "tests"), str(ROOT / "benchmarks")) if p not in rest]
    return [str(ROOT), *rest, *extra]


sys.path[:] = checkout_first(sys.path)
for _k, _v in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
               ("WANDB_MODE", "disabled"), ("TOKENIZERS_PARALLELISM", "false")):  # fmt: skip
    os.environ.setdefault(_k, _v)
# the stage workers and the servers they start: the same order
os.environ["PYTHONPATH"] = os.pathsep.join(
    checkout_first([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
)

import _gpu_check_stages as stages  # noqa: E402
import gpu_wheels  # noqa: E402

RESULT = "gpu_check.json"
MEMORY_TOLERANCE = 0.15
MOVED = 0.05  # a served logprob that moved less than this after the large step did not move
AGREE = {"cpu": 1e-2, "cuda": 3e-2}  # bf16 compute on both sides: max |server - trainer| per token
ALL_PASSED = "gpu_check: every check passed"
# after a stage's deadline: killing what it started, up to 15 s for a stopped server to exit (run_stage), the results
CLEANUP_S = 20.0


# ---------------------------------------------------------------------------------------------- checks


def sync_checks(probes: list[dict], steps: int, tol: float) -> list[tuple[str, bool]]:
    """(a) the server's own version after every step; (b) its logprobs moved, and equal the trainer's."""
    versions = [(p["step"], p["server_version"]) for p in probes]
    a_ok = len(probes) == steps + 1 and all(str(s) == v for s, v in versions)
    out = [(f"(a) server /weight_info version after each step (step, version): {versions}", a_ok)]
    if len(probes) < 2:
        return out + [("(b) served logprobs: no step finished", False)]
    before, after = probes[0], probes[-1]  # a step whose rollouts all score alike trains nothing: the last
    same = [i for i, (x, y) in enumerate(zip(before["tokens"], after["tokens"])) if x == y]
    prefix = len(same) if same == list(range(len(same))) else 0  # positions sampled after the same tokens
    moved_by = max((abs(after["server"][i] - before["server"][i]) for i in range(prefix)), default=0.0)
    moved = prefix < len(after["tokens"]) or moved_by > MOVED  # a different seeded token: the distribution moved
    out.append((f"(b) served logprobs of the fixed prompt moved over the run: max |change| {moved_by:.3f} over "
                f"{prefix} equal tokens (> {MOVED}) or the sampled tokens changed", moved))  # fmt: skip
    gaps = [max(abs(s - t) for s, t in zip(p["server"], p["trainer"])) for p in probes]
    out.append((f"(b) served logprobs equal the trainer's after each sync: max |server - trainer| per step "
                f"{[round(g, 4) for g in gaps]} (< {tol})", all(g < tol for g in gaps)))  # fmt: skip
    return out


def train_checks(rec: dict, steps: int, cuda: bool) -> list[tuple[str, bool]]:
    out = [(f"train() returned after {rec['train_s']:.1f}s", True) if "train_s" in rec
           else (f"train() did not return: {rec.get('error', 'no record')}", False)]  # fmt: skip
    if cuda and "param_devices" in rec:
        out.append((f"parameters on {rec['param_devices']}; trainable {rec['trainable_dtypes']}, frozen "
                    f"{rec['frozen_dtypes']}", rec["param_devices"] == ["cuda"]
                    and rec["trainable_dtypes"] == ["float32"]))  # fmt: skip
    out += sync_checks(rec.get("probes", []), steps, AGREE["cuda" if cuda else "cpu"])
    if rec.get("changed_only"):
        syncs = [(s["version"], s["bytes"], s["diff"], s["snapshot"]) for s in rec.get("syncs", [])]
        ok = len(syncs) == steps and [d for _, _, d, _ in syncs] == [False] + [True] * (steps - 1)
        ok = ok and all(v == snap for v, _, _, snap in syncs)
        out.append((f"(c) sync_changed_only: the first sync whole, every later one a diff; (version, bytes, diff, "
                    f"snapshot version) {syncs}", ok))  # fmt: skip
    return out


def memory_checks(rec: dict, cuda: bool) -> list[tuple[str, bool | None]]:
    if not rec.get("done"):
        return [(f"the step did not finish: {rec.get('error', 'no record')}", False)]
    est = rec["planner_allocated_bytes"] / 2**20
    what = f"shape {rec['shape']}, master {rec['master_dtypes']}: planner {est:.0f} MiB"
    if not cuda:
        return [(what + "; max_memory_allocated needs CUDA", None)]
    peak = rec["peak_allocated_bytes"] / 2**20
    ratio = est / peak
    return [(what + f", measured peak {peak:.0f} MiB: {ratio:.2f}x (within +-{MEMORY_TOLERANCE:.0%})",
             abs(ratio - 1) <= MEMORY_TOLERANCE)]  # fmt: skip


# ---------------------------------------------------------------------------------------------- processes


def descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def left_behind(pid: int, known: list[int]) -> list[str]:
    """Live processes the worker started: the launcher-marked ones (tests/procs.py) and its descendants seen."""
    import psutil
    from procs import survivors

    out = survivors(pid)
    for p in known:
        try:
            proc = psutil.Process(p)
            if proc.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p} {' '.join(proc.cmdline())[:160]}")
        except psutil.Error:
            continue
    return out


def kill_all(pid: int, known: list[int]) -> None:
    """The worker's process group, the servers the launcher marked with its pid, every descendant seen."""
    from runs import server_pids

    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    for p in {*server_pids(pid), *known}:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def run_stage(cmd: list[str], log: Path, timeout: float) -> tuple[int | None, list[str], float]:
    """Run one worker; kill everything it started at `timeout`. Returns (exit code or None if killed, what was
    left running afterwards, seconds)."""
    t0 = time.monotonic()
    seen: set[int] = set()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
        code = None
        while code is None and time.monotonic() - t0 < timeout:
            seen.update(descendants(proc.pid))
            try:
                code = proc.wait(0.5)
            except subprocess.TimeoutExpired:
                pass
        if code is None:
            kill_all(proc.pid, sorted(seen))
            proc.wait()
    deadline = time.monotonic() + 15  # a stopped server takes a moment to exit
    while (left := left_behind(proc.pid, sorted(seen))) and time.monotonic() < deadline:
        time.sleep(0.25)
    if left:
        kill_all(proc.pid, sorted(seen))
    return code, left, time.monotonic() - t0


# ---------------------------------------------------------------------------------------------- main


def stage_timeout(longest: float, left: float) -> float:
    """A stage's deadline: `longest` at most, and what is left of the budget less the cleanup after a kill."""
    return min(longest, left - CLEANUP_S)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cpu", action="store_true", help="run every stage on the CPU with small shapes")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for everything, from --started")
    ap.add_argument("--started", type=float, help="when the command started (time.time(); default: now): "
                    "gpu_check_device.sh passes its own start, so the install counts")  # fmt: skip
    ap.add_argument("--stage-timeout", type=float, default=180.0, help="seconds one stage may take at most")
    ap.add_argument("--only", choices=[*stages.TRAIN_STAGES, *stages.MEMORY_STAGES], action="append")
    ap.add_argument("--break-sync", action="store_true", help="debug: skip every sync after the first")
    ap.add_argument("--stage", help=argparse.SUPPRESS)  # worker mode
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    if a.stage:
        stages.run(a.stage, a.result, a.model_dir, a.work, a.steps, a.cpu, a.break_sync)
        return 0
    start = time.monotonic()
    # the deadline, as this process's monotonic clock reads it: --budget seconds after the command started
    deadline = start + a.budget - (time.time() - a.started if a.started is not None else 0.0)
    import torch

    cuda = torch.cuda.is_available() and not a.cpu
    if not cuda and not a.cpu:
        print("gpu_check: no CUDA device visible; --cpu runs the same stages on the CPU", flush=True)
        return 2
    import verifiers_rl

    info = {"device": "cuda" if cuda else "cpu", "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "torch": torch.__version__, "python": sys.version.split()[0], "steps": a.steps,
            "break_sync": a.break_sync, "budget_s": a.budget, "budget_left_s": round(deadline - time.monotonic(), 1),
            "verifiers_rl": str(Path(verifiers_rl.__file__).parent)}  # fmt: skip
    print(json.dumps(info), flush=True)
    info["preflight"] = gpu_wheels.unmet()  # information: the H200 ran with such lines about the image's packages
    for line in info["preflight"]:
        print(f"[warn] preflight: {line}", flush=True)
    results: dict = {"info": info, "stages": {}}
    os.makedirs(a.out, exist_ok=True)
    path = Path(a.out) / RESULT
    failed = skipped = 0
    names = a.only or [*stages.TRAIN_STAGES, *stages.MEMORY_STAGES]
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        from verifiers_rl.tiny import save_tiny_model

        model_dir = str(save_tiny_model(Path(work) / "tiny")) if deadline - time.monotonic() > CLEANUP_S else ""
        for name in names:
            timeout = stage_timeout(a.stage_timeout, deadline - time.monotonic())
            result, log = Path(work) / f"{name}.json", Path(work) / f"{name}.log"
            checks: list[tuple[str, bool | None]] = []
            if timeout < 10:
                checks = [(f"not run: the {a.budget:.0f}s budget is spent", False)]
                rec: dict = {}
            else:
                cmd = [sys.executable, os.path.abspath(__file__), "--stage", name, "--model-dir", model_dir,
                       "--work", work, "--result", str(result), "--steps", str(a.steps),
                       *(["--cpu"] * a.cpu), *(["--break-sync"] * a.break_sync)]  # fmt: skip
                code, left, wall = run_stage(cmd, log, timeout)
                rec = json.loads(result.read_text()) if result.exists() else {}
                if code is None:
                    checks.append((f"killed at its {timeout:.0f}s deadline", False))
                if name in stages.TRAIN_STAGES:
                    checks += train_checks(rec, a.steps, cuda)
                else:
                    checks += memory_checks(rec, cuda)
                tail = "; ".join(left)
                checks.append((f"nothing it started outlives it{': ' + tail if tail else ''}", not left))
                rec["wall_s"] = wall
            rec["checks"] = [{"what": w, "ok": ok} for w, ok in checks]
            bad = [w for w, ok in checks if ok is False]
            if bad and log.exists():
                rec["log_tail"] = log.read_text(errors="replace").splitlines()[-30:]
            for w, ok in checks:
                print(f"[{'skip' if ok is None else 'ok' if ok else 'FAIL'}] {name}: {w}", flush=True)
            for line in rec.get("log_tail", []):
                print(f"  | {line}", flush=True)
            failed += len(bad)
            skipped += sum(ok is None for _, ok in checks)
            results["stages"][name] = rec
            results.update(failed=failed, skipped=skipped, wall_s=time.monotonic() - start)
            path.write_text(json.dumps(results, indent=1, default=str))
    note = f" ({skipped} skipped: they need CUDA)" if skipped else ""
    print(f"gpu_check: {failed} check(s) failed" if failed else ALL_PASSED + note, flush=True)
    print(f"results -> {path} ({time.monotonic() - start:.0f}s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
