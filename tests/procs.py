"""Running the package's commands as a user does, and finding what they left running.

Processes are found through the parent-pid marker the launcher puts into every server's environment
(VF_PARENT_PID), never by name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run_command(cmd: str, *args, cwd=None, env=None, timeout=300) -> tuple[subprocess.CompletedProcess, int]:
    """Run a console script of this venv; returns (result, its pid)."""
    proc = subprocess.Popen(
        [str(BIN / cmd), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), proc.pid


def survivors(parent_pid: int) -> list[str]:
    """Command lines of live processes started for `parent_pid` (their environment holds VF_PARENT_PID)."""
    marker = f"VF_PARENT_PID={parent_pid}".encode()
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker not in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                continue
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":  # a zombie holds nothing; its parent has not reaped it yet
                continue
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return out
