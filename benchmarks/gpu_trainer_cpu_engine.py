"""The in-process trainer on a GPU with our CPU inference engine as its server, syncing over gloo: the path where
the trainer's tensors live on CUDA and the server's on the CPU (docs/gpu-status.md: it had never run on a GPU).

    python benchmarks/gpu_trainer_cpu_engine.py [--out DIR] [--steps 4] [--budget 420]   # a machine with CUDA
    python benchmarks/gpu_trainer_cpu_engine.py --cpu                                    # any machine, same checks

Each variant runs `RLTrainer(...).train()` on the tiny offline model (verifiers_rl.tiny) and the repo's
`reverse-text` environment (environments/reverse_text), with `server_mode="spawn"`, `server_engine="cpu"` and
`max_async_level=0` (every batch is sampled with the weights synced after the step before), in a worker process of
its own (a fresh CUDA context, and a variant that hangs is killed at its share of --budget):

    a-lora-merged-fp32     LoRA, merged sync (base + delta), fp32 weights
    b-lora-adapter-fp32    LoRA, lora_sync="adapter" (A/B only; the server applies them)
    c-full-fp32            full fine-tuning (use_lora=False), fp32 weights
    d-lora-bf16            LoRA, bf16=True, the model given by path (get_model's default on CUDA: bf16 weights)
    g-full-bf16            full fine-tuning, bf16=True, the model given by path (what the GPU configs run)
    e-full-fp32-socket-1mb full fine-tuning, sync_shared_memory=False, sync_bucket_mb=1, hidden 512: every byte
                           through gloo's loopback socket, tensors above the bucket size sent from CUDA memory
    f-lora-merged-fp32-shm-1mb  LoRA merged, shared-memory sync, sync_bucket_mb=1, hidden 512: small buckets through
                           /dev/shm, the merged tensors above the bucket size by gloo broadcast from CUDA memory
    (e and f run on CUDA only unless named with --only: on CPU tensors the suite covers those paths)

Checks per variant, one `[ok]`/`[FAIL]` line each: train() returned; the policy's parameters are on cuda (not with
--cpu); one metrics row per step with policy_version = the step index; the sampler and the trainer agree (max
mismatch_kl < 1e-3; bf16: reported only); the server's /weight_info says the last step's version before the server
is stopped; every step's rollouts ran in the rollout process (the environment copied with dill) and none errored;
no process the run started outlives it. A variant that raises is one `[FAIL]` line with the exception's last line
(its worker's log tail follows), and the next one still runs; a variant still running at min(--variant-timeout,
what is left of --budget) is killed with its processes. `[warn] preflight:` lines name requirements of the wheels in
.whl/ that the installed packages do not meet. Writes gpu_trainer_cpu_engine.json (device, GPU, versions, per
variant: checks, wall time, s/step, metric rows, warnings) to --out after every variant; exits 1 when a check failed.

On a machine with CUDA torch but without this project's other packages, carry the wheels in .whl/ and:
`pip install --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:$PWD python ...`.
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
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV_DIR = ROOT / "environments" / "reverse_text"  # the reverse-text environment, importable without installing it
# appended, not prepended: nothing in the repo may shadow an installed package (tests/ is here for procs.py)
for _p in (str(ROOT), str(ENV_DIR), str(ROOT / "tests")):
    if _p not in sys.path:
        sys.path.append(_p)
# offline, like the test suite; inherited by the server and rollout processes
for _k, _v in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
               ("WANDB_MODE", "disabled"), ("TOKENIZERS_PARALLELISM", "false")):  # fmt: skip
    os.environ.setdefault(_k, _v)
_pp = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
os.environ["PYTHONPATH"] = os.pathsep.join(_pp + [p for p in (str(ROOT), str(ENV_DIR)) if p not in _pp])

RESULT = "gpu_trainer_cpu_engine.json"
KL_LIMIT = 1e-3

# name: (RLConfig overrides, how the model is handed to the trainer: "float32" = a model object loaded in fp32,
# "path" = the path string, loaded by the trainer's get_model with its per-device default dtype; the tiny model's
# hidden size: 64, or 512 where some tensors (2 MiB MLP weights) must exceed a 1 MiB sync bucket)
VARIANTS = {
    "a-lora-merged-fp32": ({"lora_sync": "merged"}, "float32", 64),
    "b-lora-adapter-fp32": ({"lora_sync": "adapter"}, "float32", 64),
    "c-full-fp32": ({"use_lora": False, "learning_rate": 1e-3}, "float32", 64),
    "d-lora-bf16": ({"lora_sync": "merged", "bf16": True}, "path", 64),
    "g-full-bf16": ({"use_lora": False, "learning_rate": 1e-4, "bf16": True}, "path", 64),
    # a tensor above the bucket size is sent from where it lies (transfer/wire.py `in_place`): on CUDA, straight
    # from GPU memory into gloo's broadcast; the others are packed into host buffers
    "e-full-fp32-socket-1mb": (
        {"use_lora": False, "learning_rate": 1e-4, "sync_shared_memory": False, "sync_bucket_mb": 1}, "float32", 512),
    "f-lora-merged-fp32-shm-1mb": ({"lora_sync": "merged", "sync_bucket_mb": 1}, "float32", 512),
}  # fmt: skip
# left out of a --cpu run unless --only names them (keeps it under 3 minutes; on CPU tensors the suite covers them)
CUDA_ONLY = ("e-full-fp32-socket-1mb", "f-lora-merged-fp32-shm-1mb")


# ---------------------------------------------------------------------------------------------- the worker


def _children(pid: int) -> list[str]:
    """Live descendants of `pid` (zombies excluded), as 'pid cmdline'."""
    import psutil

    out = []
    try:
        for c in psutil.Process(pid).children(recursive=True):
            try:
                if c.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{c.pid} {' '.join(c.cmdline())[:160]}")
            except psutil.Error:
                continue
    except psutil.Error:
        pass
    return out


def _error_line(e: BaseException) -> str:
    """The exception's type and the last line of its message: what a [FAIL] line shows."""
    last = (str(e).strip().splitlines() or [""])[-1]
    return f"{type(e).__name__}: {last}"[:500]


def run_variant(name: str, model_dir: str, work: str, steps: int, cpu: bool) -> dict:
    """One variant, in this process: train, then read back what the checks need. Raises what the run raised."""
    t_import = time.perf_counter()
    import torch
    import verifiers as vf
    from procs import survivors
    from runs import tiny_rl_config
    from transformers import TrainerCallback

    from verifiers_rl.models import get_model
    from verifiers_rl.rl.trainer import RLTrainer
    from verifiers_rl.rl.trainer.callbacks import read_metrics

    import_s = time.perf_counter() - t_import
    overrides, dtype, _ = VARIANTS[name]
    out_dir = os.path.join(work, name)
    # the in-process trainer tests' tiny geometry (tests/runs.py), 4 synced on-policy steps, a server of our own
    args = tiny_rl_config(
        Path(work),
        output_dir=out_dir,
        max_steps=steps,
        max_tokens=8,
        max_seq_len=128,
        max_prompt_len=None,
        use_cpu=cpu,
        report_to="none",
        server_engine="cpu",
        sync_backend="gloo",
        max_async_level=0,
        keep_server=True,  # read the server's /weight_info after train(), then stop it here
        disable_tqdm=True,
        **overrides,
    )
    env = vf.load_environment(
        "reverse-text", num_train_examples=32, num_eval_examples=4, system_prompt="Reverse the text."
    )

    step_times: list[float] = []
    in_child: list[bool] = []  # per step: were the rollouts generated in the rollout process (rollout_process.py)?
    holder: dict = {}

    class StepTimes(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            step_times.append(time.perf_counter())
            orch = holder["trainer"].runtime.orchestrator
            in_child.append(orch is not None and getattr(orch, "process", None) is not None)

    if dtype == "float32":
        model = get_model(model_dir, model_kwargs={"dtype": torch.float32}, device="cpu" if cpu else "cuda")
    else:
        model = model_dir
    res: dict = {"name": name, "overrides": overrides, "model_given_as": dtype, "import_s": import_s}
    t0 = time.perf_counter()
    trainer = None
    try:
        trainer = holder["trainer"] = RLTrainer(model=model, env=env, args=args, callbacks=[StepTimes()])
        res["init_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        trainer.train()
        res["train_s"] = time.perf_counter() - t1
        params = list(trainer.model.parameters())
        res["param_devices"] = sorted({p.device.type for p in params})
        res["param_dtypes"] = sorted({str(p.dtype).replace("torch.", "") for p in params})
        res["trainable_dtypes"] = sorted({str(p.dtype).replace("torch.", "") for p in params if p.requires_grad})
        res["first_param_device"] = str(next(trainer.model.parameters()).device)
        # above the bucket size: sent from where it lies (transfer/wire.py `in_place`), not packed
        res["largest_tensor_mib"] = max(p.numel() * p.element_size() for p in params) / 2**20
        res["sync_bucket_mib"] = args.sync_bucket_mb
        plan = trainer.runtime.plan
        res["plan"] = {"engine": plan.engine, "lora_sync": plan.lora_sync, "sync_backend": plan.sync_backend}
        client = trainer.runtime.client
        res["sync_shared_memory"] = bool(getattr(getattr(client, "sender", None), "shared_memory", False))
        res["server_weight_version"] = client.weight_version()  # GET /weight_info on the live server
    except Exception as e:  # noqa: BLE001 - reported as a failed check; what the run left is still read below
        traceback.print_exc()
        res["error"] = _error_line(e)
    finally:
        t2 = time.perf_counter()
        if trainer is not None:
            trainer.close()
        res["close_s"] = time.perf_counter() - t2
    res["wall_s"] = time.perf_counter() - t0
    res["rollout_process_per_step"] = in_child
    res["server_stopped"] = trainer is None or trainer.runtime.session.process is None
    rows = [r for r in read_metrics(out_dir) if "policy_version" in r]
    res["rows"] = [
        {k: r.get(k) for k in ("step", "policy_version", "mismatch_kl", "ratio_mean", "reward", "loss",
                               "timing/sync_s", "timing/generation_s", "rollouts_errored")}
        for r in rows
    ]  # fmt: skip
    diffs = [b - a for a, b in zip(step_times, step_times[1:])]
    res["s_per_step"] = res["train_s"] / steps if "train_s" in res else None
    res["s_per_step_after_first"] = sorted(diffs)[len(diffs) // 2] if diffs else None
    # no process the run started outlives it: the server (VF_PARENT_PID marker) and every child of this process
    t3 = time.monotonic()
    deadline = t3 + 15
    while True:
        left = survivors(os.getpid()) + _children(os.getpid())
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    res["survivors"] = left
    res["survivors_wait_s"] = time.monotonic() - t3
    log = Path(out_dir) / "logs" / "inference.log"
    res["inference_log_tail"] = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
    return res


def worker(a) -> int:
    res: dict
    t0 = time.perf_counter()
    try:
        res = run_variant(a.variant, a.model_dir, a.work, a.steps, a.cpu)
    except BaseException as e:  # noqa: BLE001 - the parent prints it as a failed check
        traceback.print_exc()
        res = {"name": a.variant, "error": _error_line(e)}
    res["worker_s"] = time.perf_counter() - t0
    Path(a.result).write_text(json.dumps(res, indent=1, default=str))
    return 0


# ---------------------------------------------------------------------------------------------- the parent


def checks_of(res: dict, steps: int, cpu: bool) -> list[tuple[str, bool]]:
    if "error" in res:
        out = [(f"train() did not return: {res['error']}", False)]
        if "survivors" in res:
            left = "; ".join(res["survivors"])
            out.append((f"server stopped, no process outlived the run{': ' + left if left else ''}",
                        res["server_stopped"] and not left))  # fmt: skip
        return out
    rows = res["rows"]
    versions = [int(r["policy_version"]) for r in rows]
    kls = [abs(r["mismatch_kl"]) for r in rows if r.get("mismatch_kl") is not None]
    kl = max(kls, default=float("nan"))
    bf16 = "bfloat16" in res.get("param_dtypes", []) or res["overrides"].get("bf16")
    out = [(f"train() returned after {res['train_s']:.1f}s ({res['s_per_step']:.2f} s/step, "
            f"{res['s_per_step_after_first'] or float('nan'):.2f} s/step after the first; init {res['init_s']:.1f}s; "
            f"plan {res['plan']}, shm {res['sync_shared_memory']})", True)]  # fmt: skip
    if not cpu:
        out.append((f"policy parameters on {res['param_devices']} (first: {res['first_param_device']}), dtypes "
                    f"{res['param_dtypes']}", res["param_devices"] == ["cuda"]))  # fmt: skip
    out.append((f"{len(rows)} metric rows for {steps} steps, policy_version {versions}",
                len(rows) == steps and versions == list(range(steps))))  # fmt: skip
    what = f"sampler/trainer agreement: max mismatch_kl {kl:.2e}"
    out.append((what + " (bf16: reported only)", True) if bf16 else (what + f" < {KL_LIMIT:g}", kl < KL_LIMIT))
    out.append((f"server /weight_info before stop: version {res['server_weight_version']!r} (expected '{steps}')",
                res["server_weight_version"] == str(steps)))  # fmt: skip
    in_child = res.get("rollout_process_per_step", [])
    out.append((f"rollouts generated in the rollout process (the env copied with dill) at every step: {in_child}",
                len(in_child) == steps and all(in_child)))  # fmt: skip
    errored = sum(int(r.get("rollouts_errored") or 0) for r in rows)
    out.append((f"{errored} rollouts errored", errored == 0))
    left = "; ".join(res["survivors"])
    out.append((f"server stopped, no process outlived the run{': ' + left if left else ''}",
                res["server_stopped"] and not left))  # fmt: skip
    return out


# What verifiers' and the others' metadata ask for that this path never imports (read from the code; the wheels
# for the GPU machine leave them out): a preflight line about them is expected, not a problem.
LEFT_OUT = {"textual", "gepa", "math-verify", "wget", "nest-asyncio", "pyjwt", "jsonschema", "prime-tunnel",
            "platformdirs", "pycparser", "tzdata", "latex2sympy2-extended", "antlr4-python3-runtime"}  # fmt: skip
IMAGE_DEPS = ("typing-extensions", "anyio", "h11", "httpx", "httpcore", "aiohttp", "huggingface-hub", "tokenizers",
              "safetensors", "accelerate", "numpy", "regex", "rich", "jinja2", "psutil", "msgpack", "pyarrow",
              "pandas", "fsspec", "requests", "click", "protobuf", "filelock", "packaging", "pyyaml", "tqdm",
              "uvloop", "matplotlib", "xxhash", "multidict", "yarl", "typer")  # fmt: skip


def _norm(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def preflight() -> list[str]:
    """Requirements (Requires-Dist, no extras) of the wheels carried in .whl/ (or, without that folder, of the
    packages this path imports) that the installed packages do not meet: a too-old package of the machine shows
    here before it shows as an import error."""
    import importlib.metadata as md

    from packaging.requirements import Requirement

    folder = ROOT / ".whl"
    names = sorted({_norm(f.name.split("-")[0]) for f in folder.glob("*.whl")})
    names = names or ["verifiers", "transformers", "peft", "fastapi", "uvicorn", "datasets", "openai", "dill"]
    problems = []
    for name in names:
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            problems.append(f"{name}: not installed")
            continue
        for line in reqs:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if _norm(req.name) in LEFT_OUT:
                continue
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                problems.append(f"{name} needs {req}: not installed")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{name} needs {req}: {have} installed")
    return problems


def _kill_tree(pid: int) -> None:
    """The worker's process group (it started a session of its own), then the servers it started (found by the
    launcher's VF_PARENT_PID marker, as tests/procs.py finds them)."""
    from runs import server_pids

    marked = server_pids(pid)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    for p in marked:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cpu", action="store_true", help="run the trainer on the CPU (any machine)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for everything; a variant past it is killed")
    ap.add_argument("--variant-timeout", type=float, default=150.0, help="seconds one variant may take at most")
    ap.add_argument("--only", choices=sorted(VARIANTS), action="append")
    # worker mode (the parent starts one per variant)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.variant:
        return worker(a)

    start = time.monotonic()

    def log(msg: str) -> None:
        print(msg, flush=True)

    import torch

    cuda = torch.cuda.is_available() and not a.cpu
    if not cuda and not a.cpu:
        log("gpu_trainer_cpu_engine: no CUDA device visible; run with --cpu for the CPU stand-in")
        return 2
    import importlib.metadata as md

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    info = {
        "device": "cuda" if cuda else "cpu",
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if cuda else None,
        "cuda_runtime": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        **{d: version(d) for d in ("transformers", "peft", "accelerate", "verifiers", "fastapi", "uvicorn", "dill")},
        "steps": a.steps,
        "budget_s": a.budget,
    }
    log(json.dumps(info))
    info["image_deps"] = {d: version(d) for d in IMAGE_DEPS}
    try:
        info["preflight"] = preflight()
    except Exception as e:  # noqa: BLE001 - information only
        info["preflight"] = [f"preflight itself failed: {type(e).__name__}: {e}"]
    for line in info["preflight"]:
        log(f"[warn] preflight: {line}")
    results: dict = {"info": info, "variants": {}}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, RESULT)

    def save() -> None:  # after every variant: a command killed at its limit still leaves what ran
        results["wall_s"] = time.monotonic() - start
        Path(path).write_text(json.dumps(results, indent=1, default=str))

    failed = 0
    names = a.only or [n for n in VARIANTS if cuda or n not in CUDA_ONLY]
    with tempfile.TemporaryDirectory(prefix="gpu_trainer_cpu_engine_") as work:
        from verifiers_rl.tiny import save_tiny_model

        model_dirs = {
            h: str(save_tiny_model(Path(work) / f"tiny{h}", hidden=h)) for h in {VARIANTS[n][2] for n in names}
        }
        for i, name in enumerate(names):
            left = a.budget - (time.monotonic() - start)
            timeout = min(a.variant_timeout, left - 5)
            if timeout < 20:
                log(f"[FAIL] {name}: not run: {left:.0f}s of the {a.budget:.0f}s budget left")
                results["variants"][name] = {"error": "not run: budget spent"}
                failed += 1
                continue
            result, logfile = Path(work) / f"{name}.json", Path(work) / f"{name}.log"
            model_dir = model_dirs[VARIANTS[name][2]]
            cmd = [sys.executable, os.path.abspath(__file__), "--variant", name, "--model-dir", model_dir,
                   "--work", work, "--result", str(result), "--steps", str(a.steps), *(["--cpu"] * a.cpu)]  # fmt: skip
            t0 = time.monotonic()
            with open(logfile, "w") as f:
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    _kill_tree(proc.pid)
                    proc.wait()
            wall = time.monotonic() - t0
            lines = logfile.read_text(errors="replace").splitlines()
            tail = lines[-25:]
            if result.exists():
                res = json.loads(result.read_text())
            else:
                why = "timed out" if wall >= timeout else f"worker exited {proc.returncode} without a result"
                res = {"name": name, "error": f"{why} after {wall:.0f}s (limit {timeout:.0f}s)"}
            res["worker_wall_s"] = wall
            res["worker_warnings"] = [x[:300] for x in lines if "WARNING" in x or "Warning" in x][:20]
            from procs import survivors

            left_behind = survivors(proc.pid)
            checks = checks_of(res, a.steps, not cuda)
            if left_behind:
                checks.append((f"processes outlived the worker: {left_behind}", False))
                _kill_tree(proc.pid)
            res["checks"] = [{"what": w, "ok": ok} for w, ok in checks]
            bad = [w for w, ok in checks if not ok]
            if bad:
                res["worker_log_tail"] = tail
            results["variants"][name] = res
            for w, ok in checks:
                log(f"[{'ok' if ok else 'FAIL'}] {name}: {w}")
            if bad:
                log(f"  --- {name}: worker log tail ---")
                for line in tail:
                    log(f"  | {line}")
                for line in res.get("inference_log_tail", []):
                    log(f"  | server: {line}")
            failed += len(bad)
            results["failed"] = failed
            save()
            log(f"  {name}: {wall:.1f}s in its worker ({i + 1}/{len(names)}, {time.monotonic() - start:.0f}s so far)")
    results["failed"] = failed
    save()
    log(f"gpu_trainer_cpu_engine: {failed} check(s) failed" if failed else "gpu_trainer_cpu_engine: every check passed")
    log(f"results -> {path} ({results['wall_s']:.0f}s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
