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
import subprocess
import sys
import threading
import time
from pathlib import Path

from verifiers_rl.config.choices import Engine, LoraSync
from verifiers_rl.config.net import LOOPBACK, free_port, port_in_use
from verifiers_rl.errors import ServerError
from verifiers_rl.plan.devices import child_visible_devices
from verifiers_rl.plan.layout import PARENT_ENV, AdapterServing, ServerSpec
from verifiers_rl.serving.auth import TOKEN_ENV
from verifiers_rl.serving.client import InferenceClient

_PR_SET_PDEATHSIG = 1


# ---------------------------------------------------------------------- process helpers


def log_tail(path: str | os.PathLike | None) -> str:
    """The last 20 lines of a server's log, for the error that says why it did not start."""
    if not path or not Path(path).exists():
        return ""
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-20:])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the server's parent watchdog still covers it


# ---------------------------------------------------------------------- the server


class InferenceServer:
    """`with InferenceServer(model, output_dir=...) as client:` — a healthy server and a client for it.

    `engine="auto"` is resolved by the serving plan's rule (`plan.serving.resolve_engine`): `self.engine` is what
    was started, and the trainer's plan syncs by it."""

    def __init__(
        self,
        model: str,
        *,
        engine: str = "auto",
        host: str = LOOPBACK,
        port: int | None = None,
        output_dir: str | os.PathLike = "outputs",
        gpus: list[int] | None = None,
        max_model_len: int | None = None,
        data_parallel_size: int = 1,
        extra_args: list[str] | tuple[str, ...] = (),
        adapter: AdapterServing | None = None,
        weight_backend: str | None = None,
        startup_timeout: float = 600.0,
        env: dict[str, str] | None = None,
        python: str = sys.executable,
    ):
        from verifiers_rl.plan.serving import resolve_engine

        self.spec = ServerSpec(
            model,
            resolve_engine(engine),
            host=host,
            port=port,
            gpus=gpus,
            max_model_len=max_model_len,
            data_parallel_size=data_parallel_size,
            extra_args=list(extra_args),
            adapter=adapter,
            weight_backend=weight_backend,
        )
        self.startup_timeout = startup_timeout
        self.log_path = Path(output_dir) / "logs" / "inference.log"
        self.token = secrets.token_urlsafe(24)
        self.extra_env = dict(env or {})
        self.python = python  # another interpreter, e.g. a venv that holds vLLM
        self.process: subprocess.Popen | None = None
        self.client: InferenceClient | None = None
        self.client_kwargs: dict = {}  # e.g. the control / sync timeouts of the trainer's client
        self._lock = threading.Lock()
        self._stop_at_exit = False

    @property
    def engine(self) -> str:
        return self.spec.engine

    @property
    def host(self) -> str:
        return self.spec.host

    @property
    def port(self) -> int | None:
        return self.spec.port

    @property
    def base_url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    def command(self) -> list[str]:
        return self.spec.argv(self.python)

    def environment(self) -> dict[str, str]:
        env = {**os.environ, **self.extra_env, TOKEN_ENV: self.token, PARENT_ENV: str(os.getpid())}
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.spec.gpus is not None:  # indices of our visible GPUs, as the child must see them
            env["CUDA_VISIBLE_DEVICES"] = child_visible_devices(self.spec.gpus)
        return env

    def start(self) -> InferenceClient:
        from verifiers_rl.model_source import resolve_model_path

        resolve_model_path(self.spec.model)  # a missing local path fails here, in one line, not in a log
        if self.spec.port is None:
            self.spec.port = free_port(self.spec.host)
        elif port_in_use(self.spec.host, self.spec.port):
            raise ServerError(
                f"port {self.spec.port} on {self.spec.host} is already in use; pick another port "
                "(vllm_server_port / --port) or leave it unset to use a free one"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab", buffering=0)
        # the client first: whoever sees the new process (a supervisor, a test) finds its client already there
        self.client = InferenceClient(self.spec.host, self.spec.port, control_token=self.token, **self.client_kwargs)
        try:
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.environment(),
                start_new_session=True,  # own process group: stop() takes the server's children down too
                preexec_fn=_die_with_parent,
            )
        except BaseException:
            client, self.client = self.client, None
            client.close(polite=False)  # nothing listens: just its connection pool
            raise
        finally:
            log.close()
        if not self._stop_at_exit:  # once, however often it is restarted
            atexit.register(self.stop)
            self._stop_at_exit = True
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self.client

    def restart(self) -> InferenceClient:
        """Start the server again after it died: what is left of its process group is reaped, and the new one
        listens on the same port with the same token, so clients keep their address and credentials."""
        self.stop()
        return self.start()

    def _wait_healthy(self) -> None:
        """Poll /health; fail fast when the child exits, with the log's tail in the error."""
        deadline = time.monotonic() + self.startup_timeout
        while not self.client.health():
            code = self.process.poll()
            if code is not None:
                raise ServerError(f"inference server exited with code {code} before becoming healthy{self.tail()}")
            if time.monotonic() > deadline:
                raise ServerError(
                    f"inference server at {self.base_url} not healthy after {self.startup_timeout:.0f}s{self.tail()}"
                )
            time.sleep(0.1)  # a refused connection costs microseconds; each poll's wait delays the run's start

    def tail(self) -> str:
        tail = log_tail(self.log_path)
        return f"; last log lines ({self.log_path}):\n{tail}" if tail else ""

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            proc, self.process = self.process, None
            client, self.client = self.client, None
        stopped = proc is not None and proc.poll() is None and self._is_stopped(proc.pid)
        if client is not None:  # a stopped server would let the goodbye requests time out
            try:
                client.close(polite=not stopped)
            except Exception:  # noqa: BLE001 - the server may already be gone
                pass
        if proc is None or proc.poll() is not None:
            return
        # a SIGSTOPped process only acts on SIGTERM once continued: go straight to SIGKILL for it
        steps = ((signal.SIGKILL, 5.0),) if stopped else ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0))
        for sig, wait in steps:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    @staticmethod
    def _is_stopped(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
        except (OSError, IndexError):
            return False

    def status(self) -> str | None:
        """What is wrong with the server process, in words (None: it runs)."""
        proc = self.process
        if proc is None:
            return None
        code = proc.poll()
        if code is not None:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            return f"inference server (pid {proc.pid}) {how}"
        if self._is_stopped(proc.pid):
            return f"inference server (pid {proc.pid}) is stopped (SIGSTOP or a debugger) and serves nothing"
        return None

    def wait_exit(self, timeout: float) -> None:
        """Give a process that may be dying up to `timeout` seconds to exit (status() then says how it ended)."""
        proc = self.process
        if proc is not None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass

    def describe_failure(self, what: str) -> str:
        """One line naming the server, what failed and where its log is, then the log's last lines."""
        return f"{self.status() or what}; {self.location()}{self.tail()}"

    def location(self) -> str:
        return f"server {self.base_url}, log {self.log_path}"

    def kill(self) -> None:
        """SIGKILL the server's process group at once (the caller is about to exit)."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def __enter__(self) -> InferenceClient:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def server_of(plan) -> InferenceServer:
    """The inference server of a `plan.run.RunPlan` (one definition for what `--dry-run` prints and what is started)."""
    from verifiers_rl.config.lora import lora_ranks
    from verifiers_rl.plan.layout import ADAPTER_NAME, AdapterServing, has_flag

    args, serving = plan.args, plan.serving
    extra = [str(a) for a in args.server_args or []]
    share = plan.memory.gpu_memory_utilization if plan.memory is not None else None
    if share is not None and not has_flag(extra, "gpu-memory-utilization"):
        extra += ["--gpu-memory-utilization", f"{share:.2f}"]
    adapter = None
    if serving.engine == Engine.VLLM and serving.lora_sync == LoraSync.ADAPTER:
        # vLLM serves the policy as a LoRA adapter registered at startup; whoever starts the server writes it there
        adapter = AdapterServing(ADAPTER_NAME, os.path.join(args.output_dir, "adapter_step0"), lora_ranks(args))
    return InferenceServer(
        plan.model,
        engine=serving.engine,
        host=args.vllm_server_host,
        port=args.vllm_server_port,
        output_dir=args.output_dir,
        gpus=list(serving.server_gpus) if serving.server_gpus else None,
        max_model_len=args.server_max_len,
        data_parallel_size=serving.data_parallel,
        extra_args=extra,
        startup_timeout=args.vllm_server_timeout,
        env=serving.server_env(),
        adapter=adapter,
        weight_backend=serving.server_weight_backend,
    )
