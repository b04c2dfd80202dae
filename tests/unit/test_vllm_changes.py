"""inference/vllm/changes.py without vLLM: the copy-where-changed contract on a module whose `load_weights` fuses two
checkpoint tensors into one parameter (as vLLM's qkv_proj and gate_up_proj do), and the thread-local `copy_` swap.
The same code against vLLM's real model classes: tests/e2e/test_sync_changes_vllm.py."""

import threading

import pytest
import torch

from verifiers_rl.inference.vllm import changes
from verifiers_rl.sync.buckets import TensorMeta
from verifiers_rl.sync.delta import Snapshot
from verifiers_rl.sync.stream import as_stream


class Fused(torch.nn.Module):
    """`up` and `gate` rows stacked in one parameter; its loader ends in one same-shaped copy, as vLLM's do."""

    def __init__(self):
        super().__init__()
        self.gate_up = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
        for name, w in weights:
            rows = slice(0, 3) if name == "gate" else slice(3, 6)
            self.gate_up.data[rows].copy_(w)
        return {n for n, _ in weights}


def _weights(seed):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(3, 4, generator=gen).to(torch.bfloat16) for n in ("gate", "up")}


def test_changes_land_where_the_loader_puts_whole_tensors():
    model, reference = Fused(), Fused()
    old, new = _weights(0), _weights(0)
    new["gate"][1, 2] += 1  # one element: sparse
    new["up"] += 1  # every element: whole
    model.load_weights(list(old.items()))
    snap = Snapshot()
    list(snap.recording(as_stream(list(old.items()))))
    updates = [(n, u) for n, u in snap.updates(as_stream(list(new.items()))) if u is not None]
    targets = {n: TensorMeta(n, torch.bfloat16, (3, 4)) for n in new}
    changes.load_changes(model, updates, targets)
    reference.load_weights(list(new.items()))
    assert torch.equal(model.gate_up, reference.gate_up)
    assert changes.not_landed(model, updates, targets) == []
    model.gate_up.data[1, 2] = 0  # the changed element of `gate`, lost
    assert changes.not_landed(model, updates, targets) == ["gate"]


def test_a_nan_weight_is_refused_not_taken_for_unchanged():
    from verifiers_rl.sync.delta import Sparse

    update = Sparse(torch.tensor([0], dtype=torch.int32), torch.tensor([float("nan")], dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="holds NaN"):
        changes.load_changes(Fused(), [("gate", update)], {"gate": TensorMeta("gate", torch.bfloat16, (3, 4))})


def test_the_copy_swap_is_this_threads_only():
    """vLLM's own helper swaps `Tensor.copy_` for the whole process; a trainer thread in the same process (or a
    worker's other threads) must keep real copies meanwhile."""
    inside, done = threading.Event(), threading.Event()
    seen = {}

    def other_thread():
        inside.wait(10)
        dst = torch.zeros(3)
        dst.copy_(torch.ones(3))
        seen["other"] = dst.tolist()
        done.set()

    t = threading.Thread(target=other_thread)
    t.start()
    dst = torch.zeros(3)
    with changes._writes(lambda d, s: d):  # writes nothing, in this thread
        inside.set()
        assert done.wait(10)
        dst.copy_(torch.ones(3))
    t.join()
    assert seen["other"] == [1.0, 1.0, 1.0] and dst.tolist() == [0.0, 0.0, 0.0]
    dst.copy_(torch.ones(3))  # restored afterwards
    assert dst.tolist() == [1.0, 1.0, 1.0]


def test_a_loader_that_does_not_end_in_one_same_shaped_copy_is_refused():
    """A quantized layer's loader (say) copies into another shape: changes cannot be written there, and the worker
    says so rather than writing what it cannot place."""

    class Reshaping(Fused):
        def load_weights(self, weights):
            for _, w in weights:
                self.gate_up.data.view(-1)[:12].copy_(w)  # a flattened destination: not the same shape

    update = changes.Sparse(torch.tensor([0], dtype=torch.int32), torch.tensor([1.0], dtype=torch.bfloat16))
    refused = r"does not end in one same-shaped floating-point copy \(\(3, 4\) into \(12,\)"
    with pytest.raises(ValueError, match=refused):
        changes.load_changes(Reshaping(), [("gate", update)], {"gate": TensorMeta("gate", torch.bfloat16, (3, 4))})
