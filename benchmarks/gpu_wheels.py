"""Build .whl/, what a lent GPU machine (no network) needs to run benchmarks/gpu_check.py: every package of this
project's dependency closure that the machine's image does not hold (benchmarks/gpu_machine.txt), at the versions
installed here (the ones CI tested), as wheels for the machine's Python and platform. Not this project's own wheel:
the machine runs the checkout that travels with it (gpu_check_device.sh), so an edit made after the build is the
code that runs; the project's own requirements are read from the checkout's pyproject.toml too.

    .venv/bin/python benchmarks/gpu_wheels.py [--out .whl] [--python-version 3.12]   # here, with network
    bash benchmarks/gpu_check_device.sh                                             # there: install and run

Packages that publish only a source distribution are built into a wheel here, and must come out pure Python. The
folder travels with the working tree, whose limit is 64 MiB in all: the build refuses past --max-mib.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MACHINE = ROOT / "benchmarks" / "gpu_machine.txt"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")  # fmt: skip
PROJECT = "verifiers-rl"


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def machine_packages(path: Path = MACHINE) -> dict[str, str | None]:
    """{normalized name: version or None} from gpu_machine.txt (`name` or `name==version` per line)."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[norm(name)] = version or None
    return out


def checkout_requires(name: str) -> list[str] | None:
    """A distribution's requirements: this project's from the checkout's pyproject.toml (what runs on the machine
    is the checkout, not an install of it), any other's from its metadata installed here."""
    if norm(name) != PROJECT:
        return md.requires(name)
    import tomllib

    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])


def requirements(root: str, python_version: str, requires=checkout_requires) -> list[tuple[str, object]]:
    """(who, Requirement) for every requirement of `root`'s closure, read from the metadata installed here
    (`requires`), markers evaluated for the target Python. A requirement's extras count (mcp needs `pyjwt[crypto]`,
    hence cryptography); root's own extras do not. A distribution not installed here is not expanded."""
    from packaging.requirements import Requirement

    env = {"python_version": python_version, "python_full_version": f"{python_version}.0"}
    seen: set[tuple[str, str]] = set()
    todo: list[tuple[str, str]] = [(norm(root), "")]
    out = []
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        try:
            reqs = requires(name) or []
        except md.PackageNotFoundError:
            continue
        for r in map(Requirement, reqs):
            if r.marker is None or r.marker.evaluate({**env, "extra": extra}):
                out.append((name, r))
                todo += [(norm(r.name), "")] + [(norm(r.name), e) for e in sorted(r.extras)]
    return out


def closure(root: str, python_version: str, requires=checkout_requires) -> set[str]:
    """Every distribution `root` needs, itself included."""
    return {norm(root)} | {norm(r.name) for _, r in requirements(root, python_version, requires)}


def unmet(root: str = PROJECT, python_version: str | None = None) -> list[str]:
    """What the installed packages do not meet in `root`'s closure, one line each: on a lent machine, a package of
    the image too old (or too new) for what the wheels need shows here before it shows as an error."""
    python_version = python_version or "{}.{}".format(*sys.version_info[:2])
    lines = []
    for who, r in requirements(root, python_version):
        try:
            have = md.version(r.name)
        except md.PackageNotFoundError:
            lines.append(f"{who} needs {r}: not installed")
            continue
        if not r.specifier.contains(have, prereleases=True):
            lines.append(f"{who} needs {r}: {have} installed")
    return sorted(set(lines))


def to_carry(python_version: str, machine: dict[str, str | None] | None = None) -> list[tuple[str, str]]:
    """(name, version installed here) of every package of the closure the machine lacks, this project excepted."""
    machine = machine_packages() if machine is None else machine
    names = closure(PROJECT, python_version) - set(machine) - {PROJECT}
    try:
        return sorted((n, md.version(n)) for n in names)
    except md.PackageNotFoundError as e:
        raise SystemExit(
            f"gpu_wheels: {e.name} is needed but not installed here; run it from the README's venv"
        ) from None


def download(pins: list[str], out: Path, python_version: str) -> list[str]:
    """Binary wheels for the target; returns the pins that have none (pip names the first one it misses)."""
    no_binary: list[str] = []
    todo = list(pins)
    while todo:
        tag = python_version.replace(".", "")
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(out),
               "--python-version", python_version, "--implementation", "cp", "--abi", f"cp{tag}", "--abi", "abi3",
               "--abi", "none", *(a for p in PLATFORMS for a in ("--platform", p)), *todo]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode == 0:
            return no_binary
        miss = re.search(r"No matching distribution found for (\S+)", r.stderr)
        if not miss or miss.group(1) not in todo:
            raise SystemExit(f"gpu_wheels: pip download failed:\n{r.stderr[-2000:]}")
        todo.remove(miss.group(1))
        no_binary.append(miss.group(1))
    return no_binary


def build(out: Path, python_version: str, max_mib: float) -> list[Path]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    pins = [f"{n}=={v}" for n, v in to_carry(python_version)]
    sdist_only = download(pins, out, python_version)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out)]
    if sdist_only:
        before = set(out.glob("*.whl"))
        subprocess.run([*pip_wheel, *sdist_only], check=True)
        impure = [w.name for w in set(out.glob("*.whl")) - before if not w.name.endswith("-none-any.whl")]
        if impure:
            raise SystemExit(f"gpu_wheels: these have no wheel for the target and built here as compiled: {impure}")
    wheels = sorted(out.glob("*.whl"))
    mib = sum(w.stat().st_size for w in wheels) / 2**20
    if mib > max_mib:
        raise SystemExit(f"gpu_wheels: {mib:.1f} MiB of wheels, over --max-mib {max_mib}: the working tree must "
                         "stay under the device's 64 MiB")  # fmt: skip
    print(f"gpu_wheels: {len(wheels)} wheels, {mib:.1f} MiB in {out} (Python {python_version}; built from "
          f"source: {', '.join(sdist_only) or 'none'})")  # fmt: skip
    return wheels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / ".whl"))
    ap.add_argument("--python-version", default="3.12", help="the lent machine's Python (KINDS.md: 3.12.3)")
    ap.add_argument("--max-mib", type=float, default=56.0, help="the tree itself takes a few MiB of the 64")
    ap.add_argument("--list", action="store_true", help="print what would be carried, and exit")
    ap.add_argument("--image", action="store_true", help="print the image's packages the closure needs, and exit")
    a = ap.parse_args(argv)
    if a.list:
        print("\n".join(f"{n}=={v}" for n, v in to_carry(a.python_version)))
        return 0
    if a.image:  # what a rehearsal installs to stand for the machine (gpu_check_rehearsal.sh)
        image = machine_packages()
        names = (closure(PROJECT, a.python_version) & set(image)) | {"psutil", "packaging"}  # gpu_check's own
        print("\n".join(f"{n}=={image[n]}" if image[n] else n for n in sorted(names)))
        return 0
    build(Path(a.out), a.python_version, a.max_mib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
