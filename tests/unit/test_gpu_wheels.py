"""benchmarks/gpu_wheels.py: what a lent GPU machine (no network) is sent beside its image's packages. The wheel
download itself needs the network and is rehearsed by benchmarks/gpu_check_rehearsal.sh, not here."""

from __future__ import annotations

import importlib.metadata as md
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_wheels  # noqa: E402


def _fake_metadata(table: dict[str, list[str]]):
    def requires(name):
        if name not in table:
            raise md.PackageNotFoundError(name)
        return table[name]

    return requires


def test_the_closure_follows_a_requirements_extras_and_the_targets_python():
    # mcp needs pyjwt[crypto]: without the extra, cryptography was missing on the rehearsal's first try
    table = {
        "app": ["lib[crypto]", "backport; python_version < '3.12'", "pytest; extra == 'dev'"],
        "lib": ["base", "cryptography; extra == 'crypto'", "unused; extra == 'other'"],
        "cryptography": ["cffi"],
        "base": [],
        "cffi": [],
        "backport": [],
    }
    req = _fake_metadata(table)
    assert gpu_wheels.closure("app", "3.12", req) == {"app", "lib", "base", "cryptography", "cffi"}
    assert "backport" in gpu_wheels.closure("app", "3.11", req)


def test_what_is_carried_is_what_the_image_lacks_at_the_versions_installed_here():
    image = gpu_wheels.machine_packages()
    assert image["torch"] and image["transformers"] and "peft" in image and "accelerate" in image
    carried = dict(gpu_wheels.to_carry("3.12"))
    # the packages the earlier list assumed the machine had (pydantic, jiter, httptools) and the extra's one
    for name in ("pydantic", "pydantic-core", "jiter", "httptools", "cryptography", "verifiers", "trl", "fastapi"):
        assert carried.get(name) == md.version(name), name
    assert not set(carried) & set(image)
    assert "verifiers-rl" not in carried  # built from the checkout, not downloaded


def test_this_venv_meets_every_requirement_of_the_closure():
    # gpu_check prints these as `[warn] preflight:` lines on the machine; the README's venv has none (pip check)
    assert gpu_wheels.unmet() == []


def test_the_device_script_says_what_to_do_without_wheels(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(ROOT / "benchmarks" / "gpu_check_device.sh", tmp_path / "benchmarks")
    r = subprocess.run(
        ["bash", str(tmp_path / "benchmarks" / "gpu_check_device.sh")],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")},
        timeout=30,
    )
    assert r.returncode == 2 and "build it with benchmarks/gpu_wheels.py and carry it" in r.stdout


@pytest.mark.parametrize("line", ["torch==2.11.0", "transformers==5.17.0", "pydantic"])
def test_the_image_list_parses(line, tmp_path):
    f = tmp_path / "image.txt"
    f.write_text(f"# comment\n{line}  # why\n\n")
    name, _, version = line.partition("==")
    assert gpu_wheels.machine_packages(f) == {name: version or None}
