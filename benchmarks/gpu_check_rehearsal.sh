#!/usr/bin/env bash
# Rehearse the lent GPU machine's run here (network, no GPU): a venv holding only the machine image's packages that
# this project needs (gpu_machine.txt, at its versions where this Python has them), a copy of the
# working tree with .whl/ built for this Python, then gpu_check_device.sh --cpu exactly as the machine runs it.
# Usage: bash benchmarks/gpu_check_rehearsal.sh [PYTHON]   (the machine's is 3.12; about 4 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
WORK=$(mktemp -d /tmp/gpu_rehearsal.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
VER=$("$PY" -c 'import sys; print("{}.{}".format(*sys.version_info[:2]))')
"$PY" -m venv "$WORK/venv"
# the image's torch too (its CUDA build, ~4.6 GB installed; it runs on the CPU); a version this Python cannot get
# is installed unpinned
.venv/bin/python benchmarks/gpu_wheels.py --image --python-version "$VER" >"$WORK/image.txt"
for _ in 1 2 3 4 5 6; do
  if out=$("$WORK/venv/bin/pip" install -q -r "$WORK/image.txt" 2>&1); then break; fi
  miss=$(grep -o 'No matching distribution found for [^= ]*' <<<"$out" | sed 's/.* //') || { echo "$out"; exit 1; }
  echo "rehearsal: $miss unpinned (no such version for Python $VER)"
  sed -i "s/^$miss==.*/$miss/" "$WORK/image.txt"
done
mkdir "$WORK/tree"
git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C "$WORK/tree"
.venv/bin/python benchmarks/gpu_wheels.py --python-version "$VER" --out "$WORK/tree/.whl"
PYTHON="$WORK/venv/bin/python" OUT="${OUT:-/tmp/gpu_rehearsal_out}" bash "$WORK/tree/benchmarks/gpu_check_device.sh" --cpu
