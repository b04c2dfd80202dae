"""The pure parts of gathering shards to rank 0 (shard_gather.py), with the ranks' pieces simulated."""

import math
import os

import pytest
import torch

from verifiers_rl.sync.buckets import TensorMeta, plan_buckets
from verifiers_rl.sync.shard_gather import Ring, carve, carved_bytes, dim0_rows, flat_lengths, place_pieces
from verifiers_rl.sync.transport.gloo import in_place


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 7, 8, 261])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_chunk_rows_is_torch_chunk(rows, world):
    got = dim0_rows(rows, world)
    assert sum(got) == rows and len(got) == world
    chunks = torch.chunk(torch.arange(rows), world) if rows else ()
    assert got[: len(chunks)] == [len(c) for c in chunks]  # torch.chunk may give fewer chunks: the rest hold none
    assert all(n == 0 for n in got[len(chunks) :])


def _dim0_pieces(t, world):
    """FSDP2's layout: rank r holds torch.chunk's r-th piece on dim 0 (or nothing)."""
    inner = math.prod(t.shape[1:])
    rows = dim0_rows(t.shape[0], world)
    chunks = list(torch.chunk(t, world))
    return [r * inner for r in rows], [(chunks[r] if r < len(chunks) else t[:0]).reshape(-1) for r in range(world)]


def _flat_pieces(t, world):
    """ZeRO-3's layout: the tensor flattened, padded to `world` equal slices; each rank sends what lies before the
    end of the tensor."""
    size = math.ceil(t.numel() / world)
    flat = torch.cat([t.reshape(-1), torch.full((size * world - t.numel(),), float("nan"))])
    lengths = flat_lengths(t.numel(), size, world)
    return lengths, [piece[:n] for piece, n in zip(flat.split(size), lengths)]


@pytest.mark.parametrize("layout", [_dim0_pieces, _flat_pieces])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_pieces_placed_end_to_end_give_the_whole_tensors(layout, world):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g) for s in [(5, 3), (1,), (7,), (2, 2, 2), (4, 6), (3, 1)]]
    tensors.append(torch.arange(6, dtype=torch.bfloat16).view(3, 2))  # mixed dtypes in one buffer
    tensors.append(torch.randn(3, generator=g))  # after a bfloat16 tensor of 6 elements: aligned again
    laid = [layout(t, world) for t in tensors]
    assert all(sum(lengths) == t.numel() for t, (lengths, _) in zip(tensors, laid))
    sizes = [(t.numel(), t.dtype) for t in tensors]
    buf = torch.full((carved_bytes(sizes),), 255, dtype=torch.uint8)
    dests = carve(buf, sizes)
    for dest, (lengths, pieces) in zip(dests, laid):
        for r, piece in enumerate(pieces):
            place_pieces(dest, lengths, r).copy_(piece)  # what rank r's send (or rank 0's own copy) writes
    for t, dest in zip(tensors, dests):
        got = dest.view(t.shape)
        assert got.dtype == t.dtype and got.is_contiguous() and torch.equal(got, t)


def test_a_group_carved_as_its_bucket_is_sent_in_place():
    """One dtype: the carved views lie exactly at the bucket's offsets, so the sender broadcasts the buffer itself;
    tensors anywhere else are packed."""
    shapes = [(5, 3), (7,), (4, 6)]
    metas = [TensorMeta(f"t{i}", torch.float32, s) for i, s in enumerate(shapes)]
    (bucket,) = plan_buckets(metas, 1 << 20)
    sizes = [(math.prod(s), torch.float32) for s in shapes]
    buf = torch.zeros(carved_bytes(sizes) + 16, dtype=torch.uint8)
    views = [v.view(s) for v, s in zip(carve(buf, sizes), shapes)]
    payload = in_place(bucket, views)
    assert payload is not None and payload.data_ptr() == buf.data_ptr() and payload.numel() == bucket.nbytes
    views[1].fill_(1.5)
    assert payload[bucket.offsets[1] : bucket.offsets[1] + 4].view(torch.float32).item() == 1.5
    assert in_place(bucket, [torch.zeros(s) for s in shapes]) is None  # separate tensors: packed
    assert in_place(bucket, [views[0], views[2], views[1]]) is None  # not at the bucket's offsets


def test_ring_reuses_its_buffers_and_gives_oversized_groups_their_own():
    ring = Ring(slot_bytes=1000)
    first = [ring.slot(i, 800).data_ptr() for i in range(Ring.SLOTS)]
    assert len(set(first)) == Ring.SLOTS  # the groups in flight never share memory
    assert [ring.slot(i + Ring.SLOTS, 1000).data_ptr() for i in range(Ring.SLOTS)] == first  # reused, no growth
    big = ring.slot(0, 5000)
    assert big.numel() == 5000 and big.data_ptr() not in first and ring.bufs[0].numel() == 1000


# ------------------------------------------------------------------ both transports, 2 real processes over gloo


def _shapes():
    """Groups as a sync makes them: dim-0 shards (FSDP2), one with fewer rows than ranks (rank 1 holds none), flat
    padded partitions (ZeRO-3), whole parameters, bf16 next to fp32, and one group larger than a ring slot."""
    torch.manual_seed(0)
    return [
        {"a": torch.randn(7, 5), "b": torch.randn(3)},
        {"c": torch.randn(1, 4)},  # one row: rank 1's piece is empty
        {"d": torch.randn(11, 3).to(torch.bfloat16), "e": torch.randn(9, 2)},
        {"f": torch.randn(5, 5), "g": torch.randn(2, 2)},  # flat partitions of 13 padded elements
        {"h": torch.randn(6, 4)},
        {"i": torch.randn(40, 40)},  # 6.4 KB: over the 4 KB slot, memory of its own
        {"j": torch.randn(8, 3), "k": torch.randn(3, 3)},  # whole on every rank: nothing travels
    ]


def _gather_worker(rank: int, init: str, world: int, share: str) -> None:
    import torch.distributed as dist

    from verifiers_rl.sync import shard_gather
    from verifiers_rl.sync.shard_gather import Pieces, Ring, ToRankZero

    os.environ["VF_RL_SHARD_GATHER_SHM"] = "0" if share == "0" else "1"
    if share == "no-shm" and rank == 0:  # rank 0 cannot make the buffers: every rank falls back together
        shard_gather.SHM_DIR = "/nonexistent/shm"
    if share == "shm-full" and rank == 0:  # the third buffer does not fit: the two made are removed, all fall back
        shard_gather.SHM_DIR = init.removeprefix("file://").rsplit("/", 1)[0] + "/shm"
        make, calls = shard_gather._shm_file, []

        def full(nbytes, tempfile):
            calls.append(nbytes)
            if len(calls) == 3:
                raise OSError(28, "No space left on device")
            return make(nbytes, tempfile)

        shard_gather._shm_file = full
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        group = dist.new_group(list(range(world)))  # a mesh's group, as FSDP2's
        groups, ring = _shapes(), Ring(slot_bytes=4096)

        def pieces(k: int, group_tensors: dict) -> dict:
            out = {}
            for name, t in group_tensors.items():
                if k == 6:
                    out[name] = Pieces.whole_here(t)
                elif k == 3:
                    size = -(-t.numel() // world)
                    lengths = flat_lengths(t.numel(), size, world)
                    start = sum(lengths[:rank])
                    out[name] = Pieces(
                        tuple(t.shape), t.dtype, lengths, t.reshape(-1)[start : start + lengths[rank]], group
                    )
                else:
                    lengths, local = _dim0_pieces(t, world)
                    out[name] = Pieces(tuple(t.shape), t.dtype, lengths, local[rank].contiguous(), group)
            return out

        for sync in range(2):  # a second sync reuses the ring
            pending = ToRankZero(pieces(0, groups[0]), ring, 0)
            for k, tensors in enumerate(groups):
                full = pending.wait()
                pending = ToRankZero(pieces(k + 1, groups[k + 1]), ring, k + 1) if k + 1 < len(groups) else None
                if rank == 0:
                    assert full.keys() == tensors.keys(), (sync, k)
                    for name, t in tensors.items():
                        assert torch.equal(full[name], t), (sync, k, name)
                else:
                    assert full == {}
        assert ring.shared.get(group, False) is (share == "1" and world > 1), ring.shared
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "share",
    ["1", "0", "no-shm", "shm-full"],
    ids=["shared-memory", "point-to-point", "point-to-point-without-dev-shm", "point-to-point-when-dev-shm-is-full"],
)
def test_pieces_reach_rank_zero_whole_over_real_gloo(tmp_path, share):
    """Two real processes: every group arrives whole on rank 0, through /dev/shm or gloo's point-to-point (asked
    for, or because /dev/shm is not there)."""
    import torch.multiprocessing as mp

    (tmp_path / "shm").mkdir()
    mp.spawn(_gather_worker, args=(f"file://{tmp_path}/store", 2, share), nprocs=2, join=True)
    assert not list((tmp_path / "shm").iterdir())  # nothing left where the buffers were being made
    assert not [p for p in os.listdir("/dev/shm") if p.startswith("vfrl-sync-")]  # names unlinked


# ------------------------------------------------------------------ the libraries' gathers against the hand path


def _fsdp2_model(lora: bool, kind: str = "merged"):
    """The tiny model FSDP2-sharded over the 2 ranks of the default group, and its stream `kind` before that."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from verifiers_rl.sync.export import ReplicatedExport
    from verifiers_rl.tiny import build_tiny_model

    model, _ = build_tiny_model(hidden=64, layers=2)
    if lora:  # random B: the merge is not the base weight
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)  # the same adapter on both ranks: each keeps its own rows of it
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
        model = get_peft_model(model, cfg)
    want = {n: t.clone() for n, t in ReplicatedExport(model).stream(kind)}
    mesh = init_device_mesh("cpu", (2,))
    inner = model.base_model.model if lora else model
    for layer in inner.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(inner, mesh=mesh)
    return model, want


def _export_worker(rank: int, init: str, lora: bool) -> None:
    import torch.distributed as dist

    from verifiers_rl.sync.export import FSDP2Export, weight_export
    from verifiers_rl.trainer.rank_zero import RankZeroLeads

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        model, want = _fsdp2_model(lora)
        leads = RankZeroLeads(lambda: export)
        export = weight_export(model, leads=leads)
        assert isinstance(export, FSDP2Export)
        for hand in (True, False, True):  # several buckets of 64 KB; the ring reused after the library's path
            export.hand_gather = hand
            got = {}
            leads.run(lambda got=got: got.update((n, t.clone()) for n, t in export.stream("merged", 1 << 16)))
            if rank == 0:
                assert got.keys() == want.keys(), hand
                bad = [
                    (n, (got[n] - want[n]).abs().max()) for n in want if not torch.allclose(got[n], want[n], atol=1e-6)
                ]
                assert not bad, (hand, bad[:3])
            else:
                assert got == {}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora-merged"])
def test_fsdp2_merged_stream_is_the_unsharded_one_by_either_gather(tmp_path, lora):
    """Two real processes holding an FSDP2-sharded model: the merged stream rank 0 gets, through the hand path
    and through `full_tensor()` bucket by bucket, is what the unsharded model exports (LoRA merged alike)."""
    import torch.multiprocessing as mp

    mp.spawn(_export_worker, args=(f"file://{tmp_path}/store", lora), nprocs=2, join=True)


def _lead_worker(rank: int, init: str) -> None:
    import datetime

    import torch.distributed as dist

    from verifiers_rl.sync.export import is_adapter_weight, weight_export
    from verifiers_rl.trainer.rank_zero import RankZeroLeads

    # were a walk let through alone, its first gather would fail after 60 s here instead of hanging the test
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        model, want = _fsdp2_model(True, "adapter_state")
        assert want.keys() == {k for k in model.state_dict() if is_adapter_weight(k)}  # the names peft saves
        leads = RankZeroLeads(lambda: led)
        led, unled = weight_export(model, leads=leads), weight_export(model)

        def refused_alone():  # each rank in turn, the other one elsewhere (at the barrier): refused at once
            for alone in (0, 1):
                for export in (led, unled) if rank == alone else ():
                    for kind in ("merged", "adapter_state"):
                        with pytest.raises(RuntimeError, match="outside RankZeroLeads.run"):
                            next(iter(export.stream(kind)))
                dist.barrier()

        def work():  # rank 0: two walks, each opened to the other rank, which walks it as told
            merged = {n: t.clone() for n, t in led.stream("merged", 1 << 16)}
            return len(merged), {n: t.clone() for n, t in led.stream("adapter_state")}

        refused_alone()
        n, adapter = leads.run(work)  # every rank returns rank 0's result
        assert n > 0 and adapter.keys() == want.keys() and all(torch.equal(adapter[k], want[k]) for k in want)
        refused_alone()  # and again once run is over
    finally:
        dist.destroy_process_group()


def test_a_sharded_walk_opens_only_where_every_rank_joins_it(tmp_path):
    """Two real processes, FSDP2: a walk of a sharded stream begun outside RankZeroLeads.run, on either rank while
    the other is elsewhere, is refused before it gathers (it would wait forever for the other rank); inside it, each
    walk rank 0 begins is joined by the other rank, and the final model's adapter comes whole, as peft saves it."""
    import torch.multiprocessing as mp

    mp.spawn(_lead_worker, args=(f"file://{tmp_path}/store",), nprocs=2, join=True)


def test_the_hand_gather_is_the_default_on_cpu_only():
    """The hand path where bench_gather measured it faster (CPU over gloo); the libraries' gathers elsewhere (an
    accelerator's parameters: here the meta device stands in for one). An explicit choice wins either way."""
    from verifiers_rl.sync.export import FSDP2Export
    from verifiers_rl.tiny import build_tiny_model

    model, _ = build_tiny_model(hidden=64, layers=1)
    on_cpu, elsewhere = FSDP2Export(model), FSDP2Export(model.to("meta"))
    assert on_cpu.hand_gather and not elsewhere.hand_gather
    on_cpu.hand_gather, elsewhere.hand_gather = False, True
    assert not on_cpu.hand_gather and elsewhere.hand_gather
