"""Is there an RL inference server at host:port, and which? (server_mode="auto" asks before it spawns one.)

Upstream's flow was two shells: `vf-vllm --model M` (port 8000), then a training script that names no server.
A trainer that spawned its own server there would leave the user's idle, so it looks first.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import httpx

from verifiers_rl.plan.layout import engine_of_models


@dataclass
class Probe:
    state: str  # "free": nothing listens; "server": an RL inference server; "foreign": something else listens
    detail: str = ""
    engine: str | None = None  # "cpu" | "vllm" when state == "server"
    model: str | None = None


PROBE_TIMEOUT_S = 3.0  # a local server that takes longer to answer a GET is not one to train against


def _listening(host: str, port: int, timeout: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def probe_server(host: str, port: int, *, api_key: str | None = None, control_token: str | None = None) -> Probe:
    """Classify what answers at host:port, without side effects (GET /health, /v1/models, /get_world_size)."""
    if not _listening(host, port, PROBE_TIMEOUT_S):
        return Probe("free")
    base = f"http://{host}:{port}"
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    control = {"Authorization": f"Bearer {control_token}"} if control_token else {}
    try:
        with httpx.Client(base_url=base, timeout=PROBE_TIMEOUT_S) as http:
            health = http.get("/health")
            if health.status_code != 200:
                return Probe("foreign", f"{base}/health answered {health.status_code}")
            models = http.get("/v1/models", headers=auth)
            if models.status_code == 401:
                return Probe(
                    "foreign",
                    f"{base}/v1/models needs an API key: set server_api_key (or $VLLM_API_KEY) to its --api-key",
                )
            if models.status_code != 200:
                return Probe("foreign", f"{base}/v1/models answered {models.status_code}")
            data = models.json().get("data") or []
            if not data:
                return Probe("foreign", f"{base}/v1/models lists no model")
            world = http.get("/get_world_size", headers=control)
            if world.status_code == 404:
                return Probe(
                    "foreign",
                    f"{base} serves {data[0].get('id')} without the weight-sync routes (start it with vf-vllm, or "
                    "vLLM with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config)",
                )
            if world.status_code in (401, 403):
                return Probe(
                    "foreign",
                    f"{base} refused its control token ({world.status_code}): set server_control_token "
                    "(or $VF_CONTROL_TOKEN) to the token vf-vllm printed when it started",
                )
    except (httpx.HTTPError, ValueError) as e:
        return Probe("foreign", f"{base} does not speak HTTP/JSON like an inference server ({type(e).__name__})")
    return Probe("server", base, engine_of_models(data), data[0].get("id"))
