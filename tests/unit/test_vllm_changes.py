"""sync/delta.py's write into vLLM without vLLM: the copy-where-changed contract on a module whose `load_weights`
fuses two checkpoint tensors into one parameter (as vLLM's qkv_proj and gate_up_proj do), and the copy swap of the
loading thread alone. The same code against vLLM's real model classes: tests/e2e/test_sync_changes_vllm.py."""

import threading

import pytest
import torch

from verifiers_rl.sync import delta
from verifiers_rl.sync.buckets import TensorMeta
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


def _sent(old: dict, new: dict) -> delta.Outgoing:
    """The trainer's sync of `new` as changes against `old`."""
    changes = delta.Changes()
    with changes.sending(as_stream(list(old.items())), lambda: None, 1) as out:
        list(out.wire())
    with changes.sending(as_stream(list(new.items())), lambda: "1", 2) as out:
        return out


def test_changes_land_where_the_loader_puts_whole_tensors():
    model, reference = Fused(), Fused()
    old, new = _weights(0), _weights(0)
    new["gate"][1, 2] += 1  # one element: sparse
    new["up"] += 1  # every element: whole
    model.load_weights(list(old.items()))
    updates = list(_sent(old, new).updates())
    targets = {n: TensorMeta(n, torch.bfloat16, (3, 4)) for n in new}
    delta.write_through(model.load_weights, updates, targets)
    reference.load_weights(list(new.items()))
    assert torch.equal(model.gate_up, reference.gate_up)
    assert delta.not_landed(model.load_weights, updates, targets) == []
    model.gate_up.data[1, 2] = 0  # the changed element of `gate`, lost
    assert delta.not_landed(model.load_weights, updates, targets) == ["gate"]


def test_a_receiver_writes_what_arrived_and_names_a_lost_write_as_it_arrived(monkeypatch):
    """`Receiving.through` pairs the received tensors, writes them through the loader and answers with the names,
    as received, of the tensors whose changes did not land (the worker reports 0 for those)."""
    model, reference = Fused(), Fused()
    old, new = _weights(1), _weights(1)
    new["gate"][0, 0] += 1
    model.load_weights(list(old.items()))
    out = _sent(old, new)
    wire = list(out.wire())
    assert delta.Receiving(out.header).through(wire, model.load_weights) == []
    reference.load_weights(list(new.items()))
    assert torch.equal(model.gate_up, reference.gate_up)
    newer = {n: t.clone() for n, t in new.items()}
    newer["gate"][2, 3] += 1
    honest = delta.write_through
    monkeypatch.setattr(delta, "write_through", lambda load, updates, targets: honest(load, [], targets))
    out = _sent(new, newer)
    lost = delta.Receiving(out.header).through(list(out.wire()), model.load_weights)
    assert lost == ["gate#delta_index", "gate#delta_values"]


def test_a_nan_weight_is_refused_not_taken_for_unchanged():
    update = delta.Sparse(torch.tensor([0], dtype=torch.int32), torch.tensor([float("nan")], dtype=torch.bfloat16))
    targets = {"gate": TensorMeta("gate", torch.bfloat16, (3, 4))}
    with pytest.raises(ValueError, match="holds NaN"):
        delta.write_through(Fused().load_weights, [("gate", update)], targets)


def test_the_copy_swap_is_this_threads_only():
    """vLLM's own helper swaps `Tensor.copy_` for the whole process; a trainer thread in the same process (or a
    worker's other threads) must keep real copies meanwhile, and `Tensor.copy_` itself is never replaced."""
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
    dst, original = torch.zeros(3), torch.Tensor.copy_
    with delta._FinalCopy(lambda d, s: d):  # writes nothing, in this thread
        assert torch.Tensor.copy_ is original  # no process-wide swap: torch's per-thread function mode
        inside.set()
        assert done.wait(10)
        dst.copy_(torch.ones(3))
        torch.Tensor.copy_(dst, torch.ones(3))
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

    update = delta.Sparse(torch.tensor([0], dtype=torch.int32), torch.tensor([1.0], dtype=torch.bfloat16))
    refused = r"does not end in one same-shaped floating-point copy \(\(3, 4\) into \(12,\)"
    targets = {"gate": TensorMeta("gate", torch.bfloat16, (3, 4))}
    with pytest.raises(ValueError, match=refused):
        delta.write_through(Reshaping().load_weights, [("gate", update)], targets)
