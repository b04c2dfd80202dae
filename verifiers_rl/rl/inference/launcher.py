"""Spawn and own the inference server: it lives and dies with the trainer, never orphaned.

Three layers make sure of it: (1) the child gets PR_SET_PDEATHSIG=SIGTERM, so the kernel signals it when the
trainer dies, even by kill -9; (2) `vf-vllm` itself watches its parent pid and takes its whole process group
down (vLLM's own worker processes included) when the parent goes; (3) normal exit, exceptions, SIGINT and
SIGTERM in the trainer stop the server's process group through `stop()` (context manager + atexit).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from verifiers_rl.rl.inference.client import ServerError, VLLMClient, free_port
from verifiers_rl.rl.inference.control_auth import TOKEN_ENV

PARENT_ENV = "VF_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the server's parent watchdog still covers it


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


class InferenceServer:
    """`with InferenceServer(model, output_dir=...) as client:` — a healthy server and a client for it."""

    def __init__(
        self,
        model: str,
        *,
        engine: str = "auto",
        host: str = "127.0.0.1",
        port: int | None = None,
        output_dir: str | os.PathLike = "outputs",
        gpus: list[int] | None = None,
        extra_args: list[str] | tuple[str, ...] = (),
        startup_timeout: float = 600.0,
        env: dict[str, str] | None = None,
        python: str = sys.executable,
    ):
        if engine not in ("auto", "cpu", "vllm"):
            raise ValueError(f"engine={engine!r}; allowed: auto, cpu, vllm")
        self.model, self.engine, self.host = model, engine, host
        self.port = port
        self.gpus = gpus
        self.extra_args = list(extra_args)
        self.startup_timeout = startup_timeout
        self.log_path = Path(output_dir) / "logs" / "inference.log"
        self.token = secrets.token_urlsafe(24)
        self.extra_env = dict(env or {})
        self.python = python  # another interpreter, e.g. a venv that holds vLLM
        self.process: subprocess.Popen | None = None
        self.client: VLLMClient | None = None
        self._lock = threading.Lock()

    def command(self) -> list[str]:
        return [
            self.python,
            "-m",
            "verifiers_rl.rl.inference.server",
            "--engine",
            self.engine,
            "--model",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self.extra_args,
        ]

    def environment(self) -> dict[str, str]:
        env = {**os.environ, **self.extra_env, TOKEN_ENV: self.token, PARENT_ENV: str(os.getpid())}
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpus)
        return env

    def start(self) -> VLLMClient:
        from verifiers_rl.rl.trainer.utils import resolve_model_path

        resolve_model_path(self.model)  # a missing local path fails here, in one line, not in a log
        if self.port is None:
            self.port = free_port(self.host)
        elif port_in_use(self.host, self.port):
            raise ServerError(
                f"port {self.port} on {self.host} is already in use; pick another port "
                "(vllm_server_port / --port) or leave it unset to use a free one"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab", buffering=0)
        self.process = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.environment(),
            start_new_session=True,  # own process group: stop() takes the server's children down too
            preexec_fn=_die_with_parent,
        )
        log.close()
        atexit.register(self.stop)
        self.client = VLLMClient(self.host, self.port, control_token=self.token)
        try:
            self.client.wait_for_health(self.startup_timeout, process=self.process, log_path=self.log_path)
        except BaseException:
            self.stop()
            raise
        return self.client

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            proc, self.process = self.process, None
            if self.client is not None:
                try:
                    self.client.close()
                except Exception:  # noqa: BLE001 - the server may already be gone
                    pass
                self.client = None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> VLLMClient:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
