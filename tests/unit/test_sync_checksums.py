"""A sync that did not land is caught: the checksum both sides compute (sync/verify.py), the trainer's
comparison of every receiving rank's report, and the mismatch_kl guard's rule (sync/guard.py). The same
checks run against real broken syncs in tests/e2e/test_sync_verify.py."""

from __future__ import annotations

import random

import pytest
import torch

from verifiers_rl.sync.buckets import UpdateInfo
from verifiers_rl.sync.guard import MismatchGuard
from verifiers_rl.sync.verify import SyncMismatch, dropped_buckets, tensor_checksum, verify


def test_same_bytes_same_checksum_wherever_they_sit():
    x = torch.randn(1001).bfloat16()  # an odd number of 2-byte elements: a tail past the last 8-byte word
    buf = torch.zeros(4096, dtype=torch.uint8)
    buf[2 : 2 + x.numel() * 2] = x.view(torch.uint8)  # at an unaligned address, as inside a bucket
    assert tensor_checksum(buf[2 : 2 + x.numel() * 2].view(torch.bfloat16)) == tensor_checksum(x)
    assert tensor_checksum(x.clone()) == tensor_checksum(x)
    w = torch.randn(64, 32)
    assert tensor_checksum(w[:, :16]) == tensor_checksum(w[:, :16].contiguous())  # a strided view: its values
    assert tensor_checksum(w) == tensor_checksum(w.view(torch.int32))  # bytes, not values: the dtype is no matter


def test_cpu_and_gpu_arithmetic_agree():
    """A vLLM worker on a GPU checksums with torch, the trainer on CPU with numpy: the same sums modulo 2**64, also
    where the int64 sums wrap around."""
    from verifiers_rl.sync.verify import _cpu_sums, _torch_sums

    gen = torch.Generator().manual_seed(0)
    for n in (0, 7, 1024, 5000, 1024 * 300 + 11):
        words = torch.randint(-(2**62), 2**62, (n,), dtype=torch.int64, generator=gen) * 3  # wraps
        assert _cpu_sums(words) == _torch_sums(words)


def test_any_change_to_the_bytes_shows():
    w = torch.randn(4096)
    ref = tensor_checksum(w)
    flipped = w.clone()
    flipped.view(torch.int32)[1234] ^= 1 << 7  # one bit
    halves = torch.cat([w[2048:], w[:2048]])  # the same words in another order (two 8 KiB blocks swapped)
    dup = w.clone()
    dup[2048:] = w[:2048]  # one rank's shard where the other's belongs
    others = [flipped, halves, dup, w[:-1], torch.cat([w, torch.zeros(1)]), -w, w.double()]
    assert all(tensor_checksum(o) != ref for o in others)
    assert tensor_checksum(torch.zeros(8)) != tensor_checksum(torch.zeros(9))  # the length counts
    # bf16 rounding is visible: a float sum could not tell these apart
    a = torch.tensor([1.0, 1.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0, 1.0078125], dtype=torch.bfloat16)
    assert tensor_checksum(a) != tensor_checksum(b)


def test_verify_names_the_sync_the_rank_the_tensors_and_the_bytes():
    names, nbytes = ["a", "b", "c", "d"], [16, 32, 64, 128]
    sent = [1, 2, 3, 4]
    verify(7, names, nbytes, sent, {1: {"checksums": [1, 2, 3, 4]}, 2: {"checksums": [1, 2, 3, 4]}})
    with pytest.raises(SyncMismatch) as err:
        verify(7, names, nbytes, sent, {1: {"checksums": [1, 2, 3, 4]}, 2: {"checksums": [1, 9, None, 4]}})
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("weight sync to version 7 did not land on inference rank 2: ")
    assert "1 tensor holds other bytes than were sent and 1 tensor was never loaded (c, b; 96 of the sync's 240" in line
    with pytest.raises(SyncMismatch, match="inference rank 1 reported no checksums; the server runs another"):
        verify(7, names, nbytes, sent, {1: {"tensors": 4}})


def test_update_info_carries_the_report_id_and_stays_vllm_s_format_without_it():
    info = UpdateInfo(["a"], ["float32"], [[2]])
    assert info.to_dict() == {"names": ["a"], "dtype_names": ["float32"], "shapes": [[2]]}
    info.report = "7-ab"
    assert UpdateInfo.parse(info.to_dict()).report == "7-ab"
    with pytest.raises(ValueError, match="unknown keys"):
        UpdateInfo.parse({**info.to_dict(), "extra": 1})


def test_the_test_only_fault_hook(monkeypatch):
    assert dropped_buckets(5, 1) == set()
    monkeypatch.setenv("VF_TEST_SYNC_FAULT", "stale")
    assert dropped_buckets(3, 1) == {0, 1, 2}
    monkeypatch.setenv("VF_TEST_SYNC_FAULT", "skip-bucket:2")
    assert dropped_buckets(5, 1) == {2} and dropped_buckets(1, 1) == {0}
    monkeypatch.setenv("VF_TEST_SYNC_FAULT", "skip-bucket:2@2")  # data-parallel engine 1 only
    assert dropped_buckets(5, 1) == set() and dropped_buckets(5, 2) == {2}


# ---------------------------------------------------------------------------------------------- mismatch_kl guard


def _run(guard: MismatchGuard, values: list[float]) -> tuple[int, str] | None:
    """Feed a run's per-step mismatch_kl (step n's batch sampled after the sync to version n-1); the first stop."""
    for step, kl in enumerate(values, start=1):
        problem = guard.check(step, kl, step - 1)
        if problem:
            return step, problem
    return None


def test_healthy_runs_never_stop():
    rng = random.Random(0)
    cpu = [abs(rng.gauss(4e-14, 2e-14)) for _ in range(300)]  # float32 on both sides
    # bf16 kernels on a GPU: ~1e-3, lognormal noise with excursions past 3x, and a slow drift over the run
    bf16 = [1e-3 * (1 + i / 300) * rng.lognormvariate(0, 0.5) for i in range(300)]
    for values in (cpu, bf16):
        assert _run(MismatchGuard(10.0, 1e-3), values) is None


def test_a_jump_after_a_sync_stops_the_run_with_one_line():
    # measured on the tiny model (tests/e2e/test_sync_verify.py): syncs sending one rank's shard twice
    stop = _run(MismatchGuard(10.0, 1e-3), [4.26e-14, 0.0191, 0.0167])
    assert stop is not None and stop[0] == 2
    line = stop[1]
    assert "\n" not in line and line.startswith("step 2: mismatch_kl 0.0191 right after the sync to version 1 is above")
    assert "mismatch_kl_guard (0 turns the check off)" in line
    # a bf16 run's baseline: the same jump relative to its noise, caught all the same
    assert _run(MismatchGuard(10.0, 1e-3), [1e-3, 1.2e-3, 0.9e-3, 0.02])[0] == 4


def test_a_server_that_stopped_taking_syncs_is_caught_while_it_drifts():
    # measured: a sender that moved nothing (as an NCCL communicator without libnccl would), LoRA, lr 5e-3
    assert _run(MismatchGuard(10.0, 1e-3), [4.26e-14, 6.24e-4, 2.5e-3, 3.74e-3])[0] == 3
    # on a noisy bf16 run a slow climb (KL to a server k steps stale ~ k^2) cannot drag the baseline up with it
    drift = [1e-3] * 20 + [1e-3 + 4e-4 * k * k for k in range(1, 30)]
    assert _run(MismatchGuard(10.0, 1e-3), drift)[0] <= 20 + 6
    # the same climb from the first sync on
    assert _run(MismatchGuard(10.0, 1e-3), [1e-3] + [1e-3 + 4e-4 * k * k for k in range(1, 30)]) is not None


def test_the_first_step_is_held_to_guard_x_floor_and_zero_turns_the_guard_off():
    assert _run(MismatchGuard(10.0, 1e-3), [0.05])[0] == 1  # an initial sync (resume) that did not land
    assert _run(MismatchGuard(10.0, 1e-3), [5e-3, 4e-3, 6e-3, 0.03]) is None  # a noisy run sets its own baseline
    assert _run(MismatchGuard(0.0, 1e-3), [4e-14, 5.0, 9.0]) is None
    guard = MismatchGuard(10.0, 1e-3)
    assert guard.check(1, None, 0) is None and guard.check(1, 9.0, 0, trained=False) is None  # nothing trained
