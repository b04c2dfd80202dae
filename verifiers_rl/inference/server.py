"""`vf-vllm`: start the RL inference server — real vLLM on GPU, our CPU engine elsewhere.

    vf-vllm --model Qwen/Qwen3-0.6B --port 8000 [any vLLM flag ...]
    vf-vllm --engine cpu --model ./tiny --host 127.0.0.1 --port 8000

`--engine auto` (default) picks vLLM when it is installed and CUDA is visible, else the CPU engine. Flags this
parser does not know are passed to vLLM untouched (the CPU engine warns that it ignores them).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import NoReturn

from verifiers_rl.config.choices import CPU_ENGINES, ENGINES, SPARSE_NCCL, Engine, Transport
from verifiers_rl.config.net import DEFAULT_PORT, LOOPBACK, is_loopback
from verifiers_rl.inference.cpu.engine_api import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_SEQS
from verifiers_rl.inference.cpu.openmp import bound_openmp_spin
from verifiers_rl.plan.layout import PARENT_ENV
from verifiers_rl.plan.serving import resolve_engine

logger = logging.getLogger("verifiers_rl.server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vf-vllm",
        description="Inference server for verifiers-rl: vLLM (GPU) or the built-in CPU engine, one protocol.",
        epilog="Unknown flags are passed through to vLLM (e.g. --tensor-parallel-size 2 --gpu-memory-utilization 0.8).",
    )
    p.add_argument("--model", required=True, help="hub id or local directory")
    p.add_argument("--engine", choices=ENGINES, default="auto", help="default: vllm if CUDA+vLLM, else cpu")
    p.add_argument(
        "--host", default=LOOPBACK, help="bind address (default loopback; control routes stay loopback-only)"
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--served-model-name", default=None, help="name reported by /v1/models (default: --model)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help=f"prompt + completion token limit (CPU engine default: {DEFAULT_MAX_MODEL_LEN})",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help=f"sequences per batch (CPU engine default: {DEFAULT_MAX_NUM_SEQS})",
    )
    p.add_argument(
        "--cpu-engine",
        choices=CPU_ENGINES,
        default="auto",
        help="CPU engine loop: slots (ours, Llama-family models), cb (transformers continuous batching); "
        "auto: slots where supported",
    )
    p.add_argument("--api-key", default=None, help="require this key on /v1 routes")
    p.add_argument(
        "--weight-transfer-backend",
        choices=[Transport.NCCL, Transport.GLOO, SPARSE_NCCL],
        default=None,
        help="vLLM weight-sync backend (default nccl; gloo for CPU builds of vLLM; sparse_nccl for sync_changed_only "
        "over nccl)",
    )
    p.add_argument(
        "--allow-remote-control",
        action="store_true",
        help="let non-loopback clients call the weight/control routes (still token-protected)",
    )
    p.add_argument(
        "--insecure-control",
        action="store_true",
        help="no control token: any local process may pause the server or replace its weights",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="no log line per HTTP request (vLLM's flag; the trainer sets it for a CPU engine it starts)",
    )
    return p


def control_token(args) -> str | None:
    """The control routes' token: the launcher's ($VF_CONTROL_TOKEN), else one made here and left in a file
    only this user can read, where a trainer of the same user finds it (the two-shell flow needs no copy-paste)."""
    import atexit
    import secrets

    from verifiers_rl.serving.auth import TOKEN_ENV, token_file, write_token_file

    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    if args.insecure_control:
        print("vf-vllm: --insecure-control: any local process can pause this server or replace its weights", flush=True)
        return None
    token = secrets.token_urlsafe(24)
    os.environ[TOKEN_ENV] = token  # read by our app, and by the ControlGuard middleware inside vLLM
    path = write_token_file(args.port, token)
    atexit.register(lambda: token_file(args.port).unlink(missing_ok=True))
    print(
        f"vf-vllm: control token {token} (in {path} for trainers of this user on this machine; "
        f"elsewhere set VF_CONTROL_TOKEN)",
        flush=True,
    )
    return token


def exposure(host: str, port: int, engine: str, api_key: str | None, allow_remote: bool, token: str | None) -> str:
    """What a server bound to a non-loopback address exposes, in words, for its log."""
    routes = "/v1/* (generation), /health" + (
        ", and vLLM's /tokenize, /detokenize, /metrics, /version" if engine == Engine.VLLM else ""
    )
    gen = "protected by the API key" if api_key else "with NO API key: anyone who reaches this address can generate"
    if not allow_remote:
        control = "control routes (pause, weights) answer loopback clients only"
    elif token:
        control = "control routes (pause, weights) answer any client with the control token (--allow-remote-control)"
    else:
        control = "control routes (pause, weights) answer ANY client (--allow-remote-control, --insecure-control)"
    return f"vf-vllm: listening on {host}:{port}, reachable from other machines: {routes}, {gen}; {control}"


def _watch_parent(expected_ppid: int, stop) -> None:
    """Take our whole process group down when the process that launched us is gone (kill -9 included)."""
    while True:
        if os.getppid() != expected_ppid:
            logger.warning("parent process %d exited; shutting the inference server down", expected_ppid)
            stop()
            return
        time.sleep(0.5)


def _start_watchdog(stop) -> None:
    ppid = os.environ.get(PARENT_ENV)
    if ppid and ppid.isdigit():
        threading.Thread(target=_watch_parent, args=(int(ppid), stop), daemon=True).start()


def run_vllm(args, passthrough: list[str]) -> int:
    from verifiers_rl.inference.vllm_command import build_vllm_command, check_vllm

    try:
        version = check_vllm()
    except RuntimeError as e:
        print(f"vf-vllm: {e}", file=sys.stderr)
        return 2
    extra = list(passthrough) + ["--middleware", "verifiers_rl.serving.auth.ControlGuard"]
    # vf-vllm parses these flags itself (the CPU engine needs them too), so vLLM never sees them unless handed on
    if args.max_model_len:
        extra += ["--max-model-len", str(args.max_model_len)]
    if args.max_num_seqs:
        extra += ["--max-num-seqs", str(args.max_num_seqs)]
    if args.served_model_name:
        extra += ["--served-model-name", args.served_model_name]
    if args.api_key:
        extra += ["--api-key", args.api_key]
    if args.disable_uvicorn_access_log:
        extra += ["--disable-uvicorn-access-log"]
    argv, env_add = build_vllm_command(
        args.model, args.host, args.port, extra, weight_backend=args.weight_transfer_backend or "nccl"
    )
    env = {**os.environ, **env_add}
    if args.allow_remote_control:
        env["VF_ALLOW_REMOTE_CONTROL"] = "1"
    print(f"vf-vllm: vLLM {version}: {' '.join(argv)}", flush=True)
    proc = subprocess.Popen(argv, env=env)

    stopping = threading.Event()

    def stop():
        # Called from a signal handler or the parent watchdog while the main thread sits in `proc.wait()`: a second
        # wait cannot take Popen's wait lock and spins to its timeout (every stop took 10 s, then SIGKILLed vLLM,
        # which had exited cleanly in 0.5 s). So: forward SIGTERM; vLLM's exit ends the main thread's wait, and a
        # timer takes the group down if vLLM does not exit.
        if stopping.is_set():
            return
        stopping.set()
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        timer = threading.Timer(10.0, os.killpg, (os.getpgrp(), signal.SIGKILL))
        timer.daemon = True
        timer.start()

    _start_watchdog(stop)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop())
    code = proc.wait()
    return 0 if stopping.is_set() else code


def run_cpu(args, passthrough: list[str]) -> int:
    from verifiers_rl.inference.cpu.app import serve
    from verifiers_rl.serving.auth import TOKEN_ENV

    if passthrough:
        logger.warning("CPU engine ignores vLLM-only flags: %s", " ".join(passthrough))
    _start_watchdog(lambda: os._exit(1))
    try:
        serve(
            args.model,
            args.host,
            args.port,
            served_model_name=args.served_model_name,
            max_model_len=args.max_model_len or DEFAULT_MAX_MODEL_LEN,
            max_num_seqs=args.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
            cpu_engine=args.cpu_engine,
            control_token=os.environ.get(TOKEN_ENV) or None,
            api_key=args.api_key,
            allow_remote_control=args.allow_remote_control,
            log_level=args.log_level,
            access_log=not args.disable_uvicorn_access_log,
        )
    except (FileNotFoundError, NotADirectoryError, ValueError, OSError) as e:
        print(f"vf-vllm: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> NoReturn:
    """Console-script entry point. It raises SystemExit(code) itself: verifiers' own `vf-*` scripts call `main()`
    and drop its return value, and whichever package was installed last owns the script name."""
    raise SystemExit(serve_command(argv))


def serve_command(argv: list[str] | None = None) -> int:
    args, passthrough = build_parser().parse_known_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = resolve_engine(args.engine)
    token = control_token(args)
    if not is_loopback(args.host):
        print(exposure(args.host, args.port, engine, args.api_key, args.allow_remote_control, token), flush=True)
    if engine == Engine.VLLM:
        return run_vllm(args, passthrough)
    # uvicorn re-raises the SIGTERM it caught once it has shut down; with the default handler that would end
    # the process before atexit runs (the token file would stay behind)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    bound_openmp_spin()  # before our CPU engine loads torch (vLLM binds its own threads)
    return run_cpu(args, passthrough)


if __name__ == "__main__":
    main()
