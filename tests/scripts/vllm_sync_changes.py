"""Run by tests/e2e/test_sync_changes_vllm.py with the vLLM venv's python: syncs of changes only (sync/delta.py) into
vLLM's real model classes, through vLLM's real loaders, over gloo and over vLLM's sparse NCCL engines.

Real: vLLM's Qwen3 model class built by vLLM's `initialize_model` on CPU, its `load_weights` (q/k/v into qkv_proj,
gate/up into gate_up_proj, vocabulary padding), vLLM's checkpoint-patch loader (NCCL), vLLM's `Worker` weight-transfer
methods, vLLM's RL HTTP routes, our gloo engine (inference/vllm/gloo_engine.py), vLLM's `SparseNCCLWeightTransferEngine`
and `SparseNCCLTrainerWeightTransferEngine`, our client and senders, real gloo.

Replaced, because there is no GPU here:
- the linear layers keep their weights after loading (`_cpu_skip_gemm_dispatch`, vLLM's own switch): vLLM's CPU
  build otherwise keeps them only repacked for oneDNN, which a GPU build does not do;
- for NCCL, what tests/scripts/vllm_nccl_sync.py replaces: `torch.cuda`, `PyNcclCommunicator` (bytes through the real
  store), the engine client behind the routes (threads).

After every sync, every runtime parameter of the served model is compared bit for bit with a second model of the
same class that loaded the trainer's weights whole. Prints one JSON report on stdout's last line.
"""

from __future__ import annotations

import glob
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_nccl_sync as nccl_script  # noqa: E402 - the fake device, store communicator, routes and engine client

DTYPE = torch.bfloat16


def build_model(model_dir: str):
    """vLLM's model for `model_dir` on CPU (initialize_model, as vLLM's loader does), unprocessed linear layers."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    from vllm.model_executor.model_loader.utils import initialize_model

    config = VllmConfig(
        model_config=ModelConfig(model=model_dir, dtype="bfloat16", max_model_len=256, enforce_eager=True),
        device_config=DeviceConfig("cpu"),
    )
    with set_current_vllm_config(config):
        if not model_parallel_is_initialized():
            from verifiers_rl.config.net import free_port

            method = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
            init_distributed_environment(1, 0, method, 0, "gloo")
            initialize_model_parallel(1, 1)
        model = initialize_model(vllm_config=config)
    for layer in model.modules():
        if isinstance(layer, LinearBase):
            layer._cpu_skip_gemm_dispatch = True
    record_metadata_for_reloading(model)
    return config, model


def checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(f"{model_dir}/*.safetensors")):
        out.update({k: v.to(DTYPE) for k, v in load_file(f).items()})
    return out


def step(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Next weights: ~3% of each tensor's elements moved, one tensor changed everywhere (sent whole), one not at
    all (sent as nothing)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in weights.items():
        if name.endswith("layers.1.input_layernorm.weight"):
            out[name] = w.clone()
            continue
        frac = 1.0 if name == "model.norm.weight" else 0.03
        moved = torch.rand(w.shape, generator=gen) < frac
        out[name] = torch.where(moved, w + 0.05 * torch.randn(w.shape, generator=gen).to(DTYPE) + 0.01, w)
    return out


def same_as_loaded(config, served, reference, weights) -> list[str]:
    """Names of the served model's parameters that differ from the reference model's after a whole load."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config):
        reference.load_weights(list(weights.items()))
    ref = dict(reference.named_parameters())
    return [n for n, p in served.named_parameters() if not torch.equal(p, ref[n])]


def make_worker(config, engine):
    from vllm.v1.worker.gpu_worker import Worker

    worker = Worker.__new__(Worker)  # the real class's weight-transfer methods, around our model
    worker.vllm_config, worker.rank = config, 0
    worker._weight_update_active, worker._weight_update_is_draft = False, False
    worker.model_runner = type("Runner", (), {"reset_lora_state": lambda self: None})()
    worker.weight_transfer_engine = engine
    return worker


def run_syncs(client, served, reference, config, weights, report: dict, key: str) -> dict:
    """Three syncs (whole, then two of changes); after each, the served model against a whole load."""
    rows = []
    for version in (1, 2, 3):
        weights = step(weights, seed=version)
        stats = client.update_weights(list(weights.items()), version=version)
        rows.append(
            {"version": version, "bytes": stats.bytes, "differ": same_as_loaded(config, served, reference, weights)}
        )
    report[key] = {"syncs": rows, "served_version": client.weight_version()}
    return weights


def gloo_scenarios(model_dir: str, report: dict) -> None:
    from verifiers_rl.inference.vllm.gloo_engine import GlooWeightTransferEngine
    from verifiers_rl.serving.client import InferenceClient
    from verifiers_rl.sync import delta

    config, served = build_model(model_dir)
    _, reference = build_model(model_dir)
    weights = checkpoint(model_dir)
    served.load_weights(list(weights.items()))
    from vllm.config.weight_transfer import WeightTransferConfig

    engine = GlooWeightTransferEngine(WeightTransferConfig(backend="gloo"), config, torch.device("cpu"), served)
    engine_client = nccl_script.Workers([make_worker(config, engine)], update_delay_s=0.0)
    client = InferenceClient(port=nccl_script.serve(engine_client), sync_timeout=60.0)
    client.init_weight_transfer("gloo", bucket_bytes=16 * 1024, changed_only=True)
    weights = run_syncs(client, served, reference, config, weights, report, "gloo")
    report["gloo"]["full_bytes"] = sum(w.numel() * w.element_size() for w in weights.values())

    # a worker whose linear layer was repacked away (vLLM's CPU build) refuses, in one line
    layer = served.model.layers[0].mlp.down_proj
    kept, layer.weight = layer.weight, torch.nn.Parameter(torch.empty(0, dtype=DTYPE), requires_grad=False)
    report["packed_refusal"] = _error(lambda: client.update_weights(list(step(weights, 9).items()), version=9))
    layer.weight = kept

    # a change that was never written: the trainer names the tensor
    weights = step(weights, seed=4)
    client.update_weights(list(weights.items()), version=4)  # whole again (the refusal forgot the snapshot)
    real_write = delta.write_through
    lost = "model.layers.0.self_attn.k_proj.weight"
    delta.write_through = lambda load, updates, targets: real_write(load, [u for u in updates if u[0] != lost], targets)
    report["lost_write"] = _error(lambda: client.update_weights(list(step(weights, 5).items()), version=5))
    delta.write_through = real_write


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the report carries it to the test
        return f"{type(e).__name__}: {e}"
    return "no error"


def nccl_scenarios(model_dir: str, report: dict) -> None:
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseNCCLWeightTransferEngine

    from verifiers_rl.serving.client import InferenceClient

    config, served = build_model(model_dir)
    _, reference = build_model(model_dir)
    weights = checkpoint(model_dir)
    served.load_weights(list(weights.items()))
    worker_config = VllmConfig(
        model_config=config.model_config,
        parallel_config=ParallelConfig(),
        weight_transfer_config=WeightTransferConfig(backend="sparse_nccl"),
    )
    engine = SparseNCCLWeightTransferEngine(
        worker_config.weight_transfer_config, worker_config, torch.device("cpu"), served
    )
    engine_client = nccl_script.Workers([make_worker(worker_config, engine)], update_delay_s=0.0)
    client = InferenceClient(port=nccl_script.serve(engine_client), sync_timeout=60.0)
    client.init_weight_transfer("nccl", bucket_bytes=16 * 1024, changed_only=True)
    report["nccl_sender"] = type(client.sender).__name__
    run_syncs(client, served, reference, config, weights, report, "nccl")
    report["nccl"]["calls"] = list(engine_client.calls)


def main() -> None:
    from verifiers_rl.tiny import save_tiny_model

    model_dir = str(save_tiny_model(Path(sys.argv[1]) / "model"))
    report: dict = {}
    try:
        gloo_scenarios(model_dir, report)
        nccl_script.fake_device()
        import vllm.distributed.device_communicators.pynccl as pynccl

        pynccl.PyNcclCommunicator = nccl_script.StoreCommunicator
        nccl_scenarios(model_dir, report)
    except Exception as e:  # noqa: BLE001 - the report carries it to the test
        import traceback

        traceback.print_exc()
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        nccl_script.RELEASE.set()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    sys.exit(main())
