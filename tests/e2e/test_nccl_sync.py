"""NCCL sync without a GPU.

With VF_VLLM_PYTHON (the vLLM CPU venv): tests/scripts/vllm_nccl_sync.py drives our `NCCLSender` through vLLM's
real trainer engine, HTTP routes, worker and worker engine. Replaced there, and only there, because they need a
GPU: `torch.cuda`/`torch.accelerator` (availability, device index, streams, synchronize: recorded), vLLM's
`PyNcclCommunicator` (bytes carried by vLLM's real `StatelessProcessGroup` store instead), the engine client behind
the routes (the worker methods run in threads, as worker processes would), and the worker engine's layerwise-reload
start/finish (received tensors are recorded; loading is covered by test_vllm_gloo.py). The script's docstring
says the same.

Without it: the control adapter vLLM's trainer engine drives, against our real CPU server, and the errors a CPU
user gets."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from servers import NEEDS_VLLM, VLLM_PYTHON

from verifiers_rl.serving.launcher import InferenceServer
from verifiers_rl.sync.transport.nccl import SyncControl

ROOT = Path(__file__).resolve().parents[2]
needs_vllm = NEEDS_VLLM


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


# ------------------------------------------------------------------ against vLLM's real NCCL engines


@pytest.fixture(scope="module")
def report():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = ROOT / "tests" / "scripts" / "vllm_nccl_sync.py"
    out = subprocess.run([VLLM_PYTHON, str(script)], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "error" not in result, f"{result['error']}\n{out.stderr[-3000:]}"
    return result


class TestWithVLLM:
    pytestmark = needs_vllm

    def test_sender_starts_with_vllm_s_own_init_info(self, report):
        # trainer rank 0 and two workers in one group, built from vLLM's NCCLTrainerInitInfo (rank is required)
        assert report["group_ranks"] == [0, 1, 2] and set(report["group_world_sizes"]) == {3}
        assert report["init_info"] == {"packed": True, "packed_buffer_size_bytes": report["bucket_bytes"]}
        assert report["sender_device"] == "cpu"  # the communicator's device, where tensors must be

    def test_every_worker_receives_every_tensor_bit_exact(self, report):
        assert report["received_names"] == [report["sent_names"]] * 2
        assert report["max_abs_diff"] == 0.0
        assert report["stats"] == {"tensors": 24, "bytes": report["total_bytes"], "version": 7}
        assert report["weight_version"] == "7"
        assert report["calls"] == [
            "pause:keep",
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
            "reset_prefix_cache:running",  # running requests (kept by the pause) would hold stale blocks
            "resume",
        ]

    def test_a_prefix_cache_the_server_could_not_reset_fails_the_sync(self, report):
        assert report["refused_reset"].startswith("ServerError: the server could not reset its prefix cache")

    def test_a_slow_update_within_the_sync_timeout_is_not_an_error(self, report):
        # /update_weights answered after 1.5 s, the client's request timeout is 0.5 s; the sync still succeeded
        assert report["update_delay_s"] > 2 * report["request_timeout_s"]
        assert report["weight_version"] == "7"

    def test_the_current_stream_is_synchronized_before_parameters_are_read(self, report):
        # vLLM packs on its own streams: the optimizer's writes on the current stream must have landed first
        assert report["current_stream_synced_before_first_read"]

    def test_merged_tensors_are_produced_about_one_bucket_at_a_time(self, report):
        live, bucket, largest = report["max_live_bytes"], report["bucket_bytes"], report["largest_tensor_bytes"]
        assert report["total_bytes"] >= 6 * bucket  # the sync spans several buckets
        assert bucket <= live <= bucket + largest, (live, bucket, largest)

    def test_close_shuts_the_transfer_down_on_both_sides(self, report):
        assert report["close_calls"] == ["shutdown_weight_transfer_engine"]
        assert all(report["communicators_destroyed"])

    def test_a_communicator_without_nccl_is_refused(self, report):
        assert "could not load the NCCL library" in report["disabled_nccl"]

    def test_a_trainer_without_cuda_is_told_so(self, report):
        assert "needs a CUDA device in the trainer process" in report["without_cuda"]

    # The init's three stages, each made to fail or never end (INIT_BOUND_S = 2 s each; the control requests' own
    # timeout is CONTROL_TIMEOUT_S = 30 s, so only the stage bounds can end these sooner). vLLM's trainer_init
    # reads the server's answer only after ncclCommInitRank returned: the first two would wait forever there.
    def test_a_worker_that_fails_after_the_store_ends_the_init_at_once_with_the_servers_error(self, report):
        fault = report["init_faults"]["worker_fails"]
        # the stage it names is the one the trainer waited in: the store's end and the worker's error may cross
        assert "the server's init request failed while the trainer waited for the " in fault["error"]
        assert "POST /init_weight_transfer_engine failed with 500" in fault["error"]
        assert fault["seconds"] < report["init_bound_s"]  # the server's answer ended the wait, not the bound

    @pytest.mark.parametrize(
        ("fault", "stage"),
        [
            ("worker_hangs", "the communicator creation did not finish within 2s (the server's workers reached the "
                             "store but did not join"),
            ("store_unreached", "the store rendezvous did not finish within 2s (no worker of the server connected "
                                "to the trainer's store at 127.0.0.1:"),
            ("answer_never_comes", "the server's init request did not finish within 2s (the communicator is up"),
        ],
    )  # fmt: skip
    def test_a_stage_that_never_ends_is_bounded_and_named(self, report, fault, stage):
        result = report["init_faults"][fault]
        assert stage in result["error"], result
        # ended by its stage's bound, not by the control requests' timeout; the time also holds the stages before
        # it and the sender's first requests, which took 12 s once on a loaded CI machine (2 s when quiet)
        assert report["init_bound_s"] <= result["seconds"] < report["control_timeout_s"]

    # A sync whose receivers stop mid-way (sync/transport/watchdog.py): the trainer's broadcast blocks until the
    # communicator is aborted, as NCCL's does when its peers are gone; sync timeout 30 s (2 s where only the deadline
    # ends it).
    @pytest.mark.parametrize(
        ("fault", "why"),
        [
            ("worker_raises", "the server failed: ServerError: POST /update_weights failed with 500"),
            ("server_dies", "the server stopped answering /health"),
            ("silent_hang", "the server failed: ReadTimeout"),  # the request's deadline is the sync's: 2 s
        ],
    )
    def test_a_sync_whose_receivers_are_gone_is_aborted_and_named(self, report, fault, why):
        result = report["sync_faults"][fault]
        assert result["error"].startswith("SyncAborted: NCCL weight sync to version 9 aborted during /update_weights ")
        assert "tensors handed to the broadcast" in result["error"] and why in result["error"], result
        assert result["aborted"] and result["sender_closed"]  # ncclCommAbort, and the sender is not reused
        bound = report["short_timeout_s"] if fault == "silent_hang" else 5.0  # health: 2 misses 1 s apart
        assert result["seconds"] < bound + 2.0, result
        assert result["seconds"] < report["sync_timeout_s"]

    def test_a_signal_during_a_hung_sync_ends_it_at_once(self, report):
        result = report["sync_faults"]["sigterm"]  # SIGTERM 1 s into a sync that would hang for 30 s
        assert result["error"] == "StepAbandoned: 15" and result["aborted"], result
        assert result["seconds"] < 5.0

    def test_after_an_aborted_sync_a_new_server_is_synced(self, report):
        assert report["sync_faults"]["recovered"] == {"version": "10", "max_abs_diff": 0.0, "tensors": 24}

    def test_the_communicator_is_bound_to_the_trainers_device_not_the_init_threads(self, report):
        # the main thread chose device 1; the init's stage threads (and the sync's) start on device 0
        assert set(report["trainer_comm_devices"]) == {"1"}, report["trainer_comm_devices"]

    def test_sparse_patches_move_to_the_communicators_device(self, report):
        assert report["sparse_patch_devices"] == {"whole": ["meta", "meta"], "sparse": ["meta", "meta"]}
