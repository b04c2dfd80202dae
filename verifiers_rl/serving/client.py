"""InferenceClient: the trainer's handle on an inference server — vLLM or our CPU engine, same routes.
(`VLLMClient`, its name in verifiers 0.1.14's shim, is the same class.)

HTTP is public (`get`, `post`, `models`, `health`) so that weight senders and tools never reach into the
client. A weight sync is pause -> sender.send(tensors, version) -> resume; what a sender does in between
(describe the sync, move the bytes, finish with the version) lives in `transfer/`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import httpx

from verifiers_rl.config.net import LOOPBACK
from verifiers_rl.errors import ServerError
from verifiers_rl.serving.auth import TOKEN_HEADER, needs_control, under_api_key
from verifiers_rl.sync.backends import create_sender
from verifiers_rl.sync.sender import NamedTensors, SyncStats, WeightSender

logger = logging.getLogger(__name__)
# What a request meets on a keep-alive connection the server has closed since its last answer (vLLM closes it
# after a 500): an idempotent request is sent once more, on a new connection.
STALE_CONNECTION = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
# A listener that answers /health with anything but 200 or 503 this long is not a server that is starting.
FOREIGN_AFTER_S = 5.0


class InferenceClient:
    def __init__(
        self,
        host: str = LOOPBACK,
        port: int = 8000,
        *,
        base_url: str | None = None,
        control_token: str | None = None,
        api_key: str | None = None,
        connection_timeout: float = 300.0,
        request_timeout: float = 30.0,
        sync_timeout: float = 600.0,
    ):
        """`request_timeout`: deadline of one control request (a frozen server must not hang the trainer);
        `sync_timeout`: deadline of the requests and broadcasts of one weight sync."""
        self.host, self.port = host, port
        self.base_url = (base_url or f"http://{host}:{port}").rstrip("/")
        self.connection_timeout = connection_timeout
        self.api_key = api_key or "EMPTY"
        self.control_token = control_token
        self._http = httpx.Client(base_url=self.base_url, timeout=request_timeout)
        self.sync_timeout = sync_timeout
        self.sender: WeightSender | None = None

    # ------------------------------------------------------------------ HTTP

    def _headers(self, path: str) -> dict[str, str]:
        # the API key (vLLM's --api-key) guards /v1; the control token every other route (serving/auth.py)
        key = {"Authorization": f"Bearer {self.api_key}"} if self.api_key and self.api_key != "EMPTY" else {}
        if not (needs_control(path) and self.control_token):
            return key
        if under_api_key(path):  # /v1 and control at once (the runtime LoRA routes): the token in its own header
            return {**key, TOKEN_HEADER: self.control_token}
        return {"Authorization": f"Bearer {self.control_token}"}

    def _check(self, method: str, path: str, r: httpx.Response) -> dict:
        if r.status_code >= 400:
            raise ServerError(f"{method} {path} failed with {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else {}

    def get(self, path: str, *, timeout: float | None = None) -> dict:
        kwargs = {"timeout": timeout} if timeout is not None else {}
        return self._check("GET", path, self._http.get(path, headers=self._headers(path), **kwargs))

    def post(
        self,
        path: str,
        json: dict | None = None,
        *,
        params: dict | None = None,
        timeout: float | None = None,
        idempotent: bool = False,
    ) -> dict:
        kwargs = {"timeout": timeout} if timeout is not None else {}
        try:
            r = self._http.post(path, json=json, params=params, headers=self._headers(path), **kwargs)
        except STALE_CONNECTION:
            if not idempotent:
                raise
            r = self._http.post(path, json=json, params=params, headers=self._headers(path), **kwargs)
        return self._check("POST", path, r)

    def models(self) -> list[dict]:
        return self.get("/v1/models")["data"]

    def health(self, timeout: float = 5.0) -> bool:
        return self.answer("/health", timeout) == "200"

    def answer(self, path: str, timeout: float = 5.0) -> str | None:
        """What answers GET `path`: "200", another status with the server's name ("404 from SimpleHTTP/0.6"), a
        listener that does not speak HTTP, or None when nothing listens (yet)."""
        try:
            r = self._http.get(path, timeout=timeout)
        except (httpx.ConnectError, httpx.TimeoutException):  # nothing listens yet, or a busy server: wait on
            return None
        except httpx.TransportError as e:  # something listens, but not an HTTP server (or it broke the reply)
            return f"a listener that does not answer HTTP ({type(e).__name__})"
        if r.status_code == 200:
            return "200"
        server = r.headers.get("server")
        return f"{r.status_code}" + (f" from {server}" if server else "")

    def wait_for_health(self, timeout: float | None = None) -> None:
        """Poll /health until it answers 200, or raise ServerError after `timeout` seconds. A listener that
        keeps answering something else for FOREIGN_AFTER_S seconds is named at once: it is not an inference
        server starting up (vLLM and our engine listen only once they serve; 503 is a server still loading)."""
        timeout = self.connection_timeout if timeout is None else timeout
        start = time.monotonic()
        deadline, odd_since = start + timeout, None
        while (answer := self.answer("/health")) != "200":
            now = time.monotonic()
            foreign = answer is not None and not answer.startswith("503")
            odd_since = (odd_since or now) if foreign else None
            if odd_since is not None and now - odd_since >= FOREIGN_AFTER_S:
                raise ServerError(
                    f"{self.base_url} is not an inference server: GET /health answered {answer} for "
                    f"{now - odd_since:.0f}s; point the trainer at the server (vllm_server_host / vllm_server_port, "
                    "[inference] host / port) or stop what listens there"
                )
            if now > deadline:
                raise ServerError(f"inference server at {self.base_url} not healthy after {timeout:.0f}s")
            time.sleep(0.25)

    # ------------------------------------------------------------------ control

    def get_world_size(self) -> int:
        return int(self.get("/get_world_size")["world_size"])

    def is_paused(self) -> bool:
        return bool(self.get("/is_paused")["is_paused"])

    def pause(self, mode: str = "keep") -> None:
        self.post("/pause", params={"mode": mode}, idempotent=True)

    def resume(self) -> None:
        self.post("/resume", idempotent=True)

    @contextlib.contextmanager
    def paused(self, mode: str = "keep") -> Iterator[None]:
        self.pause(mode)
        try:
            yield
        except BaseException:
            try:
                self.resume()
            except Exception as e:  # noqa: BLE001 - the error inside is the one the caller must see
                logger.warning("could not resume the inference server after a failed weight sync: %s", e)
            raise
        self.resume()

    def reset_prefix_cache(self, *, timeout: float | None = None) -> None:
        """Drop every KV block cached under the old weights. vLLM cannot while running requests hold blocks (a
        sync under `pause(keep)` always has them) and then answers 200 with `success: false`: so it is asked to
        preempt those requests too, which resume by recomputing their tokens under the new weights."""
        answer = self.post("/reset_prefix_cache", params={"reset_running_requests": "true"}, timeout=timeout)
        if answer.get("success") is False:
            raise ServerError(
                "the server could not reset its prefix cache (/reset_prefix_cache answered success=false): new "
                "requests would reuse keys and values computed with the old weights"
            )

    def weight_version(self) -> str | None:
        return self.get("/weight_info").get("weight_version")

    # ------------------------------------------------------------------ weight transfer

    def init_weight_transfer(
        self,
        backend: str = "gloo",
        *,
        host: str = LOOPBACK,
        bucket_bytes: int | None = None,
        timeout_s: float | None = None,
        server_pauses: bool = False,
        shared_memory: bool = True,
        changed_only: bool = False,
    ) -> WeightSender:
        """Join the server's workers in a weight-transfer group (`sync.backends.create_sender` backends).
        `server_pauses`: the server pauses and resumes itself around a sync (our CPU engine, gloo).
        `shared_memory`: with `server_pauses` and a loopback `host`, offer the server buckets through shared
        memory (sync/transport/shm.py); False keeps every byte on gloo. `changed_only`: after the first sync, send only
        the elements that changed (sync/delta.py), over gloo or NCCL (vLLM's `sparse_nccl` backend)."""
        timeout_s = self.sync_timeout if timeout_s is None else timeout_s
        sender = create_sender(  # a backend it refuses leaves the group this client has, as it was
            backend, self, host=host, bucket_bytes=bucket_bytes, timeout_s=timeout_s, changed_only=changed_only
        )
        self.close_weight_transfer()
        if server_pauses:
            sender.pauses_itself = True
        if not shared_memory:
            sender.offers_shared_memory = False
        sender.init()
        self.sender = sender
        return sender

    @property
    def bucket_bytes(self) -> int | None:
        return getattr(self.sender, "bucket_bytes", None)

    def update_weights(self, named_tensors: NamedTensors, *, version: int) -> SyncStats:
        """One sync; generation is paused around it (in-flight requests keep their KV cache and resume)."""
        if self.sender is None:
            raise ServerError("call init_weight_transfer() before update_weights()")
        if getattr(self.sender, "pauses_itself", False):
            return self.sender.send(named_tensors, version)
        with self.paused("keep"):
            return self.sender.send(named_tensors, version)

    def relabel(self, version: int, was: int | None) -> None:
        """The server keeps the weights it serves as `was` and serves them as `version` (nothing trained since);
        a sender that keeps state about those weights follows."""
        self.post("/update_weight_version", {"new_version": str(version)})
        relabel = getattr(self.sender, "relabel", None)
        if relabel is not None:
            relabel(version, was)

    def close_weight_transfer(self, polite: bool = True) -> None:
        sender, self.sender = self.sender, None
        if sender is not None:
            sender.close(polite=polite)

    def close(self, polite: bool = True) -> None:
        """`polite=False`: the server is known to be dead or stuck; tell it nothing."""
        self.close_weight_transfer(polite)
        self._http.close()


# The name verifiers 0.1.14's shim imports (`verifiers_rl.serving.client:VLLMClient`), and upstream's.
VLLMClient = InferenceClient

__all__ = ["InferenceClient", "ServerError", "VLLMClient"]
