"""Port 8000 across pytest-xdist workers.

A trainer with server_mode="auto" connects to whatever RL server answers on port 8000. test_users_paths starts the
user's own server there and checks that exactly its trainer trained it, so no test on the other worker may run while
that server is up. Every test holds a shared lock on the default port (conftest); the user's server holds it
exclusively, and queues through a turnstile first so the other worker's stream of tests cannot starve it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile

_LOCKS = os.path.join(tempfile.gettempdir(), f"verifiers-rl-tests-{os.getuid()}-port8000")


@contextlib.contextmanager
def _flock(path: str, mode: int):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


@contextlib.contextmanager
def default_port_exclusive():
    """Port 8000 for this test alone; waits for the other worker's running test to finish."""
    with contextlib.ExitStack() as held:
        with _flock(_LOCKS + ".turnstile", fcntl.LOCK_EX):
            held.enter_context(_flock(_LOCKS + ".lock", fcntl.LOCK_EX))
        yield


@contextlib.contextmanager
def default_port_shared():
    with _flock(_LOCKS + ".turnstile", fcntl.LOCK_EX):
        pass  # a test waiting for the exclusive lock goes first
    with _flock(_LOCKS + ".lock", fcntl.LOCK_SH):
        yield
