"""Waiting on a condition instead of sleeping a fixed time: a fixed sleep is either too short on a loaded CI machine
(the assert after it fails) or too long everywhere else. Each wait fails with what it waited for."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

T = TypeVar("T")


def _tail(log: Path | None) -> str:
    return log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    what: str,
    *,
    interval: float = 0.05,
    proc: subprocess.Popen | None = None,
    log: Path | None = None,
) -> T:
    """Poll `predicate` until it returns something truthy and return that. Fails after `timeout` seconds, or as soon
    as `proc` (the process that should bring the condition about) has exited, naming `what` and `log`'s tail."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited ({proc.returncode}) first\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f}s\n{_tail(log)}")
        time.sleep(interval)


def healthy(url: str) -> bool:
    """Whether GET url/health answers 200 now (a refused or slow connection is a no, not an error)."""
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(url: str, timeout: float = 120, *, proc=None, log: Path | None = None) -> None:
    """Wait until the server at `url` answers /health; fails early if `proc` (the server) exits."""
    wait_until(lambda: healthy(url), timeout, f"{url}/health answering 200", interval=0.1, proc=proc, log=log)
