"""The GPU check a lent machine runs (benchmarks/gpu_check_device.sh, issue 54): it runs the checkout, never a wheel
of this project carried or installed earlier, and its budget is a deadline from the command's start, the install
included, so the command ends inside the machine's limit. On the CPU, with wheels made here and tiny budgets; what
the GPU stages measure needs the machine."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


def _wheel(folder: Path, dist: str, version: str, files: dict[str, str]) -> Path:
    """A pure-Python wheel pip installs (its RECORD hashed as pip expects)."""
    info = f"{dist.replace('-', '_')}-{version}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    path = folder / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_the_checkout_holds_one_package_at_its_root():
    """Why the checkout may go first on the path: verifiers_rl is all it can shadow."""
    modules = sorted(p.name for p in ROOT.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists())
    assert modules == ["verifiers_rl"]
    assert gpu_check.checkout_first(["/site", str(ROOT)])[:2] == [str(ROOT), "/site"]


def test_the_device_script_runs_the_checkout_and_counts_the_install(tmp_path):
    """An old .whl/ with this project's wheel in it, and another copy of verifiers_rl on PYTHONPATH: the check runs
    the checkout's. A 25 s budget from the script's start leaves no stage room (each needs its cleanup and 10 s):
    they are reported as not run, and the whole command ends inside the 25 s."""
    whl, shadow = tmp_path / "whl", tmp_path / "shadow" / "verifiers_rl"
    whl.mkdir()
    shadow.mkdir(parents=True)
    stale = 'raise ImportError("a stale copy of verifiers_rl ran instead of the checkout")\n'
    _wheel(whl, "verifiers-rl", "0.0.1", {"verifiers_rl/__init__.py": stale})
    _wheel(whl, "vf-carried-dep", "1.0", {"vf_carried_dep.py": "CARRIED = True\n"})
    (shadow / "__init__.py").write_text(stale)
    env = {**os.environ, "WHL_DIR": str(whl), "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
           "PYTHONPATH": str(shadow.parent)}  # fmt: skip
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check_device.sh"), "--cpu", "--budget", "25"],
                       capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    wall = time.monotonic() - t0
    out = r.stdout
    assert "not installing verifiers_rl-0.0.1-py3-none-any.whl: the checkout runs" in out, out + r.stderr
    info = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert info["verifiers_rl"] == str(ROOT / "verifiers_rl")
    assert info["budget_left_s"] < 25  # the install and the imports before it were counted
    assert "not run: the 25s budget is spent" in out and r.returncode == 1
    assert wall < 25


def test_a_stage_and_its_cleanup_end_inside_what_is_left(tmp_path):
    left = 24.0
    timeout = gpu_check.stage_timeout(180.0, left)
    assert timeout == left - gpu_check.CLEANUP_S
    code, survivors, wall = gpu_check.run_stage(["sleep", "60"], tmp_path / "stage.log", timeout)
    assert code is None and not survivors  # killed at its deadline, with what it started
    assert wall < left
