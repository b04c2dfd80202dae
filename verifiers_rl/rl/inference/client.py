"""VLLMClient: the trainer's handle on an inference server — vLLM or our CPU engine, same routes.

A sync is one control round trip around a bucketed broadcast:
pause(keep) -> start_weight_update -> update_weights{names, dtypes, shapes} ‖ broadcast buckets
-> finish_weight_update{weight_version} -> reset_prefix_cache -> resume.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from verifiers_rl.rl.inference.transfer import gloo
from verifiers_rl.rl.inference.transfer.buckets import (
    DEFAULT_BUCKET_BYTES,
    TensorMeta,
    metas_to_update_info,
    plan_buckets,
)


class ServerError(RuntimeError):
    """The inference server failed, or never came up; the message carries its log tail when known."""


@dataclass
class SyncStats:
    seconds: float
    bytes: int
    tensors: int
    buckets: int
    version: int


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: str | os.PathLike | None, lines: int = 20) -> str:
    if not path or not Path(path).exists():
        return ""
    text = Path(path).read_text(errors="replace").splitlines()[-lines:]
    return "\n".join(text)


class VLLMClient:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        base_url: str | None = None,
        control_token: str | None = None,
        api_key: str | None = None,
        connection_timeout: float = 300.0,
        request_timeout: float = 600.0,
    ):
        self.host, self.port = host, port
        self.base_url = (base_url or f"http://{host}:{port}").rstrip("/")
        self.connection_timeout = connection_timeout
        self.api_key = api_key or "EMPTY"
        headers = {"Authorization": f"Bearer {control_token}"} if control_token else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=request_timeout)
        self._pg = None
        self._nccl = None
        self.bucket_bytes = DEFAULT_BUCKET_BYTES
        self.version = 0

    # ------------------------------------------------------------------ health and control

    def wait_for_health(self, timeout: float | None = None, *, process=None, log_path=None) -> None:
        """Poll /health until it answers 200. Fails fast if `process` (a Popen) exits; errors carry the log tail."""
        deadline = time.monotonic() + (timeout if timeout is not None else self.connection_timeout)
        while True:
            if process is not None and process.poll() is not None:
                tail = log_tail(log_path)
                raise ServerError(
                    f"inference server exited with code {process.returncode} before becoming healthy"
                    + (f"; last log lines ({log_path}):\n{tail}" if tail else "")
                )
            try:
                if self._http.get("/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                tail = log_tail(log_path)
                raise ServerError(
                    f"inference server at {self.base_url} not healthy after {timeout or self.connection_timeout:.0f}s"
                    + (f"; last log lines ({log_path}):\n{tail}" if tail else "")
                )
            time.sleep(0.25)

    def _post(self, path: str, json=None, params=None) -> dict:
        r = self._http.post(path, json=json, params=params)
        if r.status_code >= 400:
            raise ServerError(f"POST {path} failed with {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else {}

    def _get(self, path: str) -> dict:
        r = self._http.get(path)
        if r.status_code >= 400:
            raise ServerError(f"GET {path} failed with {r.status_code}: {r.text[:500]}")
        return r.json()

    def get_world_size(self) -> int:
        return int(self._get("/get_world_size")["world_size"])

    def is_paused(self) -> bool:
        return bool(self._get("/is_paused")["is_paused"])

    def pause(self, mode: str = "keep") -> None:
        self._post("/pause", params={"mode": mode})

    def resume(self) -> None:
        self._post("/resume")

    def reset_prefix_cache(self) -> None:
        self._post("/reset_prefix_cache")

    def weight_version(self) -> str | None:
        return self._get("/weight_info").get("weight_version")

    # ------------------------------------------------------------------ weight transfer

    def init_weight_transfer(
        self,
        *,
        backend: str = "gloo",
        host: str = "127.0.0.1",
        port: int | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 300.0,
    ) -> None:
        """Create the trainer-side group (rank 0, store owner) while the server joins it.

        gloo: our bucketed broadcast (CPU engine, and vLLM with our plugin). nccl: vLLM's own packed NCCL
        engine (GPU only; trainer and server on different GPUs)."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}; allowed: gloo, nccl")
        world = 1 + self.get_world_size()
        port = port or free_port(host)
        self.bucket_bytes = bucket_bytes
        if backend == "nccl":
            from verifiers_rl.rl.inference.transfer.nccl import NCCLSender

            self._nccl = NCCLSender(self, host=host, port=port, world_size=world, bucket_bytes=bucket_bytes).init()
            return
        info = {
            "master_address": host,
            "master_port": port,
            "rank_offset": 1,
            "world_size": world,
            "bucket_bytes": bucket_bytes,
        }
        result = self._in_thread(lambda: self._post("/init_weight_transfer_engine", json={"init_info": info}))
        self._pg = gloo.create_group(host, port, 0, world, timeout_s=timeout_s)
        result.join()

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int | None = None,
        lora_scaling: float | None = None,
    ) -> SyncStats:
        """One sync: one update_weights request describing every tensor, then bucketed broadcasts."""
        if self._nccl is not None:
            return self._update_weights_nccl(named_tensors, version)
        if self._pg is None:
            raise ServerError("call init_weight_transfer() before update_weights()")
        t0 = time.perf_counter()
        tensors = dict(named_tensors)
        metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
        buckets = plan_buckets(metas, self.bucket_bytes)
        info = metas_to_update_info(metas)
        if lora_scaling is not None:
            info["lora_scaling"] = lora_scaling  # ours: adapter-only sync, CPU engine only
        self.version = self.version + 1 if version is None else version
        self.pause("keep")
        try:
            self._post("/start_weight_update")
            pending = self._in_thread(lambda: self._post("/update_weights", json={"update_info": info}))
            sent = gloo.send_buckets(self._pg, buckets, tensors)
            pending.join()
            self._post("/finish_weight_update", json={"weight_version": str(self.version)})
            self.reset_prefix_cache()
        finally:
            self.resume()
        return SyncStats(time.perf_counter() - t0, sent, len(metas), len(buckets), self.version)

    def _update_weights_nccl(self, named_tensors, version: int | None) -> SyncStats:
        t0 = time.perf_counter()
        self.version = self.version + 1 if version is None else version
        self.pause("keep")
        try:
            n, nbytes = self._nccl.send(named_tensors, self.version)
            self.reset_prefix_cache()
        finally:
            self.resume()
        return SyncStats(time.perf_counter() - t0, nbytes, n, 0, self.version)

    def close_weight_transfer(self) -> None:
        if self._nccl is not None:
            self._nccl.shutdown()
            self._nccl = None
        if self._pg is not None:
            try:
                self._post("/shutdown_weight_transfer_engine")
            except (ServerError, httpx.HTTPError):
                pass
            self._pg = None

    def close(self) -> None:
        self.close_weight_transfer()
        self._http.close()

    @staticmethod
    def _in_thread(fn) -> _Result:
        res = _Result(fn)
        res.start()
        return res


class _Result(threading.Thread):
    """A control request that must run while this thread broadcasts; join() re-raises its error."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.error, self.value = fn, None, None

    def run(self):
        try:
            self.value = self.fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in join()
            self.error = e

    def join(self, timeout=None):
        super().join(timeout)
        if self.error is not None:
            raise self.error
        return self.value
