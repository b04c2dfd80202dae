"""Inference never imports the trainer: the server loads a model without Trainer, verifiers or the training
code (so `vf-vllm` starts fast and a trainer bug cannot break serving).

accelerate itself is imported by transformers' own model loader (`transformers.core_model_loading`) when it is
installed, so the runtime check cannot exclude it; the static check makes sure none of our inference modules
imports it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "verifiers_rl"
SERVING_SIDE = ("inference", "serving")
TRAINING_SIDE = ("trainer", "rollouts", "batch", "loss", "scripts")
FORBIDDEN = tuple(f"verifiers_rl.{p}" for p in TRAINING_SIDE) + ("accelerate", "verifiers", "trl", "datasets")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):  # lazy imports inside functions count too
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_no_module_under_inference_imports_the_trainer():
    offenders = {
        str(p.relative_to(PACKAGE)): name
        for side in SERVING_SIDE
        for p in (PACKAGE / side).rglob("*.py")
        for name in _imports(p)
        if name in FORBIDDEN or name.startswith(tuple(f + "." for f in FORBIDDEN))
    }
    assert not offenders, offenders


def test_serving_a_model_loads_no_training_stack(tiny_model_dir):
    code = f"""
import sys
import verifiers_rl.inference.cpu.app, verifiers_rl.inference.server, verifiers_rl.serving.client
from verifiers_rl.inference.cpu.cb_engine import CPUEngine
engine = CPUEngine.from_pretrained({tiny_model_dir!r}, max_model_len=64, max_num_seqs=2)
engine.close()
bad = ("verifiers", "trl", "peft", "datasets", "wandb", "transformers.trainer", "verifiers_rl.trainer",
       "verifiers_rl.rollouts", "verifiers_rl.batch", "verifiers_rl.loss", "verifiers_rl.scripts")
print(sorted(m for m in sys.modules if m in bad or m.startswith(tuple(b + "." for b in bad))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
