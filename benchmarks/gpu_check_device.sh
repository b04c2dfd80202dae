#!/usr/bin/env bash
# What a lent GPU machine runs (no network, no vLLM): install the carried wheels (.whl/, built here by
# benchmarks/gpu_wheels.py) beside the image's own packages, then the GPU check. Arguments go to gpu_check.py.
#   run(command="bash benchmarks/gpu_check_device.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
ls .whl/*.whl >/dev/null 2>&1 || { echo "gpu_check_device: no .whl/ here: build it with benchmarks/gpu_wheels.py and carry it"; exit 2; }
# --target, not the image's site-packages: the image stays as it was, and the carried packages are only packages
# the image lacks (gpu_machine.txt), so nothing of the image is shadowed
SITE=$(mktemp -d /tmp/gpu_check_site.XXXXXX)
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl || exit 3
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" benchmarks/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
