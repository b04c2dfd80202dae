"""Network helpers every part of inference shares: ports, and which hosts count as this machine.

"Is this host local" has one answer here. Two questions use it: may a client reach the control routes
(`is_loopback`: only the loopback interface), and does a server run on this machine (`is_local`: loopback or
the wildcard address a local server binds to).
"""

from __future__ import annotations

import ipaddress
import socket

LOOPBACK = "127.0.0.1"  # where a server the trainer starts listens unless told otherwise
# where vf-vllm listens by default, where a trainer connects, and where server_mode="auto" looks first
DEFAULT_PORT = 8000
# How long a server keeps an idle connection. uvicorn's and vLLM's default (5 s) equals the OpenAI client's own
# keep-alive expiry (httpx: 5 s), so a connection left idle across a training step can be closed by the server
# just as the client reuses it: the request fails with "Server disconnected" (seen on the first steps of a
# multi-turn run, 4 of 64 rollouts). Longer on the server side, the client always drops an idle connection first.
SERVER_KEEP_ALIVE_S = 75


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def is_loopback(host: str | None) -> bool:
    """A loopback address or name (`testclient` is Starlette's test client, and None a unix socket)."""
    if host in (None, "testclient", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_local(host: str | None) -> bool:
    """A server at `host` runs on this machine: loopback, or the wildcard address ("0.0.0.0", "::")."""
    if host in ("0.0.0.0", "::"):
        return True
    return is_loopback(host)


def store_host_for(server_host: str) -> str:
    """The address the trainer's weight-sync store listens on: loopback for a local server (nothing else can
    reach it), else the one interface this machine uses to reach the server."""
    try:
        if is_local(server_host) or ipaddress.ip_address(socket.gethostbyname(server_host)).is_loopback:
            return LOOPBACK
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((server_host, 9))  # no packet is sent: this only picks the route's source address
            return probe.getsockname()[0]
    except OSError:
        return LOOPBACK
