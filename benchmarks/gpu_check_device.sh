#!/usr/bin/env bash
# What a lent GPU machine runs (no network, no vLLM): install the carried wheels (.whl/, built here by
# benchmarks/gpu_wheels.py) beside the image's own packages, then the GPU check from this checkout. Arguments go to
# gpu_check.py; its --budget (540 s) counts from this script's start, the install included, so the whole command
# ends inside the machine's 600 s.
#   run(command="bash benchmarks/gpu_check_device.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
START=$(date +%s.%N)  # before anything: the budget is the command's, not the check's
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu_check_out}
WHL=${WHL_DIR:-.whl}
mkdir -p "$OUT"
ls "$WHL"/*.whl >/dev/null 2>&1 || { echo "gpu_check_device: no $WHL/ here: build it with benchmarks/gpu_wheels.py and carry it"; exit 2; }
# never this project's own wheel (an older .whl/ holds one): the checkout runs, edits since the build included
WHEELS=()
for w in "$WHL"/*.whl; do
  case "$(basename "$w")" in
    verifiers_rl-*) echo "gpu_check_device: not installing $(basename "$w"): the checkout runs" ;;
    *) WHEELS+=("$w") ;;
  esac
done
# --target, not the image's site-packages: the image stays as it was, and the carried packages are only packages
# the image lacks (gpu_machine.txt), so nothing of the image is shadowed
SITE=$(mktemp -d /tmp/gpu_check_site.XXXXXX)
if [ ${#WHEELS[@]} -gt 0 ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${WHEELS[@]}" || exit 3
fi
# the checkout first (its verifiers_rl is the only package at its root), then the carried packages
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" benchmarks/gpu_check.py --out "$OUT" --started "$START" "$@" 2>&1 | tee "$OUT/gpu_check.log"
