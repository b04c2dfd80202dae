"""NCCL sync cannot run here (no GPU, no vLLM in this venv). What can run: the control adapter that vLLM's
trainer engine drives, against our real CPU server, and the errors a CPU user gets."""

import pytest

from verifiers_rl.rl.inference.launcher import InferenceServer
from verifiers_rl.rl.inference.transfer.nccl import NCCLSender, SyncControl


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    with InferenceServer(tiny_model_dir, engine="cpu", output_dir=tmp_path_factory.mktemp("nccl")) as c:
        yield c


def test_sync_control_speaks_the_weight_routes(client):
    control = SyncControl(client)
    control.start_weight_update()
    assert client.is_paused()  # our engine holds the batching loop while weights change
    control.next_version = 5
    control.finish_weight_update()
    assert client.weight_version() == "5"
    assert not client.is_paused()
    control.finish_weight_update("9")  # an explicit version wins
    assert client.weight_version() == "9"


def test_sync_control_surfaces_server_errors(client):
    with pytest.raises(Exception, match="init_info needs master_address"):
        SyncControl(client).init_weight_transfer_engine({"world_size": 2})


def test_nccl_backend_without_vllm_is_a_clear_error(client):
    with pytest.raises(RuntimeError, match="NCCL weight sync needs vLLM"):
        client.init_weight_transfer(backend="nccl")


def test_unknown_backend(client):
    with pytest.raises(ValueError, match="allowed: gloo, adapter, nccl"):
        client.init_weight_transfer(backend="tcp")


def test_sender_reports_missing_cuda_before_touching_vllm_groups(client, monkeypatch):
    import sys
    import types

    # Only to reach the CUDA check: a stand-in module with the two names NCCLSender imports.
    fake = types.ModuleType("vllm.distributed.weight_transfer.nccl_engine")
    fake.NCCLTrainerInitInfo = object
    fake.NCCLTrainerWeightTransferEngine = object
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer.nccl_engine", fake)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        NCCLSender(client, host="127.0.0.1").init()
