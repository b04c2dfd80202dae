"""Send only what changed (sync/delta.py): the diff in the wire dtype, the sparse/dense break-even, the
receiver's apply and pairing, and the trainer's snapshot, tensor by tensor."""

from __future__ import annotations

import pytest
import torch

from verifiers_rl.sync import delta
from verifiers_rl.sync.buckets import TensorMeta, UpdateInfo, pack, plan_buckets, unpack
from verifiers_rl.sync.stream import as_stream
from verifiers_rl.sync.verify import tensor_checksum


def _bf16(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _receiving(*names: str, shape=(64,)) -> delta.Receiving:
    """The receiver's side of a sync of changes to bf16 tensors `names` of `shape`."""
    whole = UpdateInfo.from_metas([TensorMeta(n, torch.bfloat16, shape) for n in names]).to_dict()
    return delta.Receiving({"base_version": "0", **whole})


def test_a_small_change_is_sparse_and_applying_it_gives_the_new_tensor_exactly():
    old = _bf16(1000).view(10, 100)
    new = old.clone()
    new.view(-1)[[3, 500, 999]] += 1.0
    update = delta.diff(old, new)
    assert isinstance(update, delta.Sparse)
    assert update.index.dtype == torch.int32 and update.index.tolist() == [3, 500, 999]
    assert update.values.dtype == torch.bfloat16
    served = old.float()  # the CPU engine holds float32: bf16 values land exactly
    delta.apply(served, update)
    assert torch.equal(served.to(torch.bfloat16), new)
    assert tensor_checksum(served.to(torch.bfloat16)) == tensor_checksum(new)


def test_the_change_is_measured_in_the_wire_dtype():
    master = torch.randn(4096, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).float()
    stepped = master * (1 + 1e-5)  # an fp32 step far below half a bf16 step: every fp32 element changed
    assert delta.diff(master.to(torch.bfloat16), stepped.to(torch.bfloat16)) is None
    assert isinstance(delta.diff(master, stepped), torch.Tensor)  # in fp32 it is all change: dense


def test_bits_decide_not_float_equality():
    old = torch.tensor([0.0, float("nan"), 1.0], dtype=torch.bfloat16)
    new = torch.tensor([-0.0, float("nan"), 1.0], dtype=torch.bfloat16)
    update = delta.diff(old, new)
    assert update.index.tolist() == [0]  # -0.0 has other bytes; NaN with the same bits is no change
    delta.apply(old, update)
    assert torch.equal(old.view(torch.int16), new.view(torch.int16))


def test_sparse_up_to_the_break_even_and_dense_past_it():
    # bf16 with int32 indices: k changes cost 6k bytes against 2n for the whole tensor; break-even at k = n/3
    n = 300
    old = torch.zeros(n, dtype=torch.bfloat16)
    at = old.clone()
    at[:100] = 1.0  # 600 bytes == 600 bytes: still sparse
    past = old.clone()
    past[:101] = 1.0
    assert delta.sparse_nbytes(100, n, 2) == 2 * n
    assert isinstance(delta.diff(old, at), delta.Sparse)
    assert delta.diff(old, past) is past
    assert isinstance(delta.diff(old, at, threshold=0.5), torch.Tensor)  # a lower threshold goes dense sooner
    served = old.clone()
    delta.apply(served, delta.diff(old, past))
    assert torch.equal(served, past)


def test_indices_widen_past_int32():
    assert delta.index_dtype(2**31 - 1) == torch.int32
    assert delta.index_dtype(2**31) == torch.int64
    assert delta.sparse_nbytes(10, 2**31, 2) == 100


def test_pairing_rejoins_an_index_and_its_values_across_buckets():
    t = torch.zeros(64, dtype=torch.bfloat16)
    new = t.clone()
    new[[1, 2, 40]] = 3.0
    wire = delta.wire_items("w", delta.diff(t, new)) + [("b", torch.ones(4))]
    metas = [TensorMeta(n, x.dtype, tuple(x.shape)) for n, x in wire]
    buckets = plan_buckets(metas, bucket_bytes=12)  # the index (12 B) and the values (6 B) in two buckets
    assert [m.name for m in buckets[0].metas] == ["w#delta_index"]
    pairing, got = _receiving("w", "b"), {}
    buf = torch.empty(max(b.nbytes for b in buckets), dtype=torch.uint8)
    for bucket in buckets:
        ts = [dict(wire)[m.name] for m in bucket.metas]
        for name, u in pairing.updates(unpack(bucket, pack(bucket, ts, out=buf[: bucket.nbytes]))):
            got[name] = u if not isinstance(u, delta.Sparse) else delta.Sparse(u.index, u.values.clone())
        buf.fill_(0xFF)  # the staging buffer is reused: a kept view would now read garbage
    assert set(got) == {"w", "b"}
    served = t.clone()
    delta.apply(served, got["w"])
    assert torch.equal(served, new)
    with pytest.raises(ValueError, match="without their indices"):
        list(_receiving("x").updates([("x#delta_values", torch.ones(2))]))


def test_changes_are_sent_against_the_servers_version_only_and_the_snapshot_keeps_the_new_tensors():
    a, b, c = _bf16(3000, 1), _bf16(10, 2), _bf16(50, 3)
    changes = delta.Changes()

    def never_asked():
        raise AssertionError("nothing to diff against: the server's version is not read")

    with changes.sending(as_stream([("a", a), ("b", b), ("c", c)]), never_asked, 4) as out:
        assert out.header is None and [n for n, _ in out.wire()] == ["a", "b", "c"]
    assert changes.version == 4
    a2, b2 = a.clone(), b.clone() + 1
    a2[7] += 1
    with changes.sending(as_stream([("a", a2), ("b", b2), ("c", c)]), lambda: "4", 5) as out:
        wire = out.wire()
        assert [m.name for m in wire.metas] == ["a#delta_index", "a#delta_values", "b"]
        assert out.header["base_version"] == "4" and out.header["names"] == ["a", "b", "c"]
        assert [m.name for m in out.targets] == ["a", "b", "c"]
        assert out.checksums == [tensor_checksum(x) for x in (a2, b2, c)]
        assert wire.nbytes == 6 + 20
    assert (changes.version, changes.diffed) == (5, 1)
    assert torch.equal(changes.tensors["a"], a2) and torch.equal(changes.tensors["b"], b2)
    changes.relabel(6, was=4)  # not the version it holds: the next sync must not count on it
    assert changes.version == 5
    changes.relabel(6, was=5)  # the same weights, served as 6
    with changes.sending(as_stream([("a", a2), ("b", b2), ("c", c)]), lambda: "6", 7) as out:
        assert out.wire().nbytes == 0 and out.header["base_version"] == "6"
    with changes.sending(as_stream([("a", a), ("b", b), ("c", c)]), lambda: "3", 8) as out:  # moved without us
        assert out.header is None and sum(t.nbytes for _, t in out.wire()) == a.nbytes + b.nbytes + c.nbytes
    with pytest.raises(RuntimeError, match="lost"), changes.sending(as_stream([("a", a)]), never_asked, 9):
        raise RuntimeError("the sync was lost")
    assert changes.version is None and changes.tensors == {}  # the server may hold anything: the next sync is whole


def test_a_corrupted_delta_shows_in_the_checksums():
    old = _bf16(2048)
    new = old.clone()
    new[::97] += 0.5
    update = delta.diff(old, new)
    served = old.clone()
    bad = delta.Sparse(update.index, update.values.clone())
    bad.values[0] += 1.0
    delta.apply(served, bad)
    assert tensor_checksum(served) != tensor_checksum(new)


def test_update_info_carries_the_header_and_the_receiver_checks_it():
    targets = [TensorMeta("w", torch.bfloat16, (4, 4))]
    info = UpdateInfo.from_metas([TensorMeta("w#delta_index", torch.int32, (2,))])
    info.delta = {"base_version": "3", **UpdateInfo.from_metas(targets).to_dict()}
    parsed = UpdateInfo.parse(info.to_dict())
    assert delta.receiving(parsed).targets == targets and delta.receiving(parsed, served=3).refused is None
    with pytest.raises(ValueError, match="a delta against version 3 cannot apply to version 2"):
        raise delta.receiving(parsed, served=2).refused
    assert delta.receiving(UpdateInfo.parse(UpdateInfo.from_metas(targets).to_dict())) is None
    parsed.delta["names"] = ["w", "x"]
    with pytest.raises(ValueError, match="update_info.delta lists differ in length"):
        delta.receiving(parsed)
    parsed.delta.pop("base_version")
    with pytest.raises(ValueError, match="base_version"):
        delta.receiving(parsed)


def test_indices_behind_an_odd_number_of_values_unpack_from_one_bucket():
    old = torch.zeros(2, 64, dtype=torch.bfloat16)
    new = old.clone()
    new[0, [1, 2, 3]] = 1.0  # 3 bf16 values: the next tensor's int32 indices start 2 bytes off alignment
    new[1, 5] = 2.0
    wire = delta.wire_items("a", delta.diff(old[0], new[0])) + delta.wire_items("b", delta.diff(old[1], new[1]))
    (bucket,) = plan_buckets([TensorMeta(n, x.dtype, tuple(x.shape)) for n, x in wire])
    assert bucket.offsets[2] % 4 == 2
    updates = dict(_receiving("a", "b").updates(unpack(bucket, pack(bucket, [x for _, x in wire]))))
    served = old.clone()
    delta.apply(served[0], updates["a"])
    delta.apply(served[1], updates["b"])
    assert torch.equal(served, new)


def test_a_tensor_of_another_shape_or_dtype_is_an_error():
    with pytest.raises(ValueError, match="cannot compare"):
        delta.diff(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(3, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="cannot compare"):
        delta.diff(torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16))


def test_sparse_nccl_refuses_a_tensor_its_int32_indices_cannot_address():
    """vLLM's sparse engine indexes with int32: past 2**31 elements our int64 index would wrap, so it is refused
    (checked before vLLM is imported: this runs without it)."""
    from verifiers_rl.sync.transport.sparse_nccl import _patch

    big = delta.Sparse(torch.tensor([2**31 + 5], dtype=torch.int64), torch.ones(1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2147483648 elements; vLLM's sparse_nccl indexes with int32"):
        _patch("model.embed_tokens.weight", big, (2**20, 2**11), None)
