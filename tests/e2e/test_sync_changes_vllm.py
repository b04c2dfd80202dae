"""Syncs of changes only (sync_changed_only) into vLLM's real model classes and loaders: over gloo through our
worker engine, over NCCL through vLLM's own sparse engines. tests/scripts/vllm_sync_changes.py runs them in the
vLLM CPU venv and says there what is replaced (the linear layers keep their weights as on a GPU; for NCCL, CUDA and
the communicator). After every sync every runtime parameter is compared with a whole load of the trainer's
weights, bit for bit."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from servers import NEEDS_VLLM, VLLM_PYTHON

ROOT = Path(__file__).resolve().parents[2]
pytestmark = NEEDS_VLLM


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = ROOT / "tests" / "scripts" / "vllm_sync_changes.py"
    out = subprocess.run(
        [VLLM_PYTHON, str(script), str(tmp_path_factory.mktemp("changes"))],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "error" not in result, f"{result['error']}\n{out.stderr[-3000:]}"
    return result


@pytest.mark.parametrize("transport", ["gloo", "nccl"])
def test_every_sync_lands_as_a_whole_load_would(report, transport):
    syncs = report[transport]["syncs"]
    assert [s["differ"] for s in syncs] == [[], [], []]  # fused q/k/v and gate/up, padded vocabulary: all equal
    assert report[transport]["served_version"] == "3"


def test_changes_move_a_fraction_of_the_bytes(report):
    full = report["gloo"]["full_bytes"]
    first, *changes = (s["bytes"] for s in report["gloo"]["syncs"])
    assert first == full  # the first sync is whole
    assert all(c < full / 5 for c in changes)  # ~3% of the elements moved: indices and values, and one whole tensor
    nccl_first, *nccl_changes = (s["bytes"] for s in report["nccl"]["syncs"])
    assert nccl_first == 3 * full  # vLLM's sparse engine takes patches only: every index (int32) beside bf16 values
    assert all(c < full / 5 for c in nccl_changes)


def test_nccl_runs_vllms_sparse_engine_in_chunks(report):
    assert report["nccl_sender"] == "SparseNCCLSender"
    calls = report["nccl"]["calls"]
    first = calls[: calls.index("finish_weight_update")]
    assert first.count("start_weight_update") == 1 and first.count("update_weights") > 1  # a bucket per request


def test_a_change_that_did_not_land_is_named(report):
    line = report["lost_write"]
    assert line.startswith("SyncMismatch: weight sync to version 5 did not land on inference rank 1")
    assert "model.layers.0.self_attn.k_proj.weight#delta_values" in line


def test_a_vllm_that_repacked_its_weights_refuses_in_one_line(report):
    line = report["packed_refusal"]
    assert "refused by the server (inference rank 1)" in line
    assert "model.layers.0.mlp.down_proj.weight only repacked" in line and "needs vLLM on a GPU" in line
