"""Weight sync through shared memory (sync/transport/shm.py) into a real CPU-engine server on this machine.

The trainer offers /dev/shm slots to our CPU engine on loopback; the same bucket plan, checksums and reports
apply, so a sync that went through shared memory is verified like any other: these tests check that the path is
taken, that it lands (the server's own read-back checksums equal the trainer's), that a bucket larger than a
slot still travels (by gloo broadcast, in its turn), that a receiver dropping a bucket is caught, and that the
receiver maps nothing it was not meant to.
"""

from __future__ import annotations

import os

import pytest

from verifiers_rl.serving.launcher import InferenceServer
from verifiers_rl.sync.buckets import TensorMeta, plan_buckets
from verifiers_rl.sync.transport.shm import SHM_DIR, SharedSlots
from verifiers_rl.sync.verify import FAULT_ENV, SyncMismatch
from verifiers_rl.tiny import build_tiny_model

BUCKET_BYTES = 16 * 1024  # several buckets, and the embedding (261 x 64 fp32, 67 KB) larger than one

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm on this machine")


def _metas(model) -> list[TensorMeta]:
    return [TensorMeta(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = InferenceServer(tiny_model_dir, engine="cpu", output_dir=tmp_path_factory.mktemp("shm"))
    srv.start()
    yield srv
    srv.stop()


def test_a_local_cpu_engine_takes_buckets_through_shared_memory(server):
    client = server.client
    sender = client.init_weight_transfer("gloo", bucket_bytes=BUCKET_BYTES, server_pauses=True)
    assert sender.shared_memory
    assert not os.path.exists(sender.group.shm.path)  # unlinked once both sides mapped it: nothing left behind
    other = build_tiny_model(seed=1)[0]
    buckets = plan_buckets(_metas(other), BUCKET_BYTES)
    assert len(buckets) > 4 and any(b.nbytes > BUCKET_BYTES for b in buckets)  # both paths in one sync
    for version, model in ((3, other), (4, build_tiny_model(seed=2)[0])):
        stats = client.update_weights(model.named_parameters(), version=version)  # verified: raises if not landed
        assert stats.bytes == sum(b.nbytes for b in buckets)
        assert client.weight_version() == str(version)


def test_shared_memory_off_keeps_every_byte_on_gloo(server):
    client = server.client
    sender = client.init_weight_transfer("gloo", bucket_bytes=BUCKET_BYTES, server_pauses=True, shared_memory=False)
    assert not sender.shared_memory
    client.update_weights(build_tiny_model(seed=3)[0].named_parameters(), version=7)
    assert client.weight_version() == "7"


def test_a_receiver_dropping_a_shared_bucket_is_caught(tiny_model_dir, tmp_path):
    srv = InferenceServer(tiny_model_dir, engine="cpu", output_dir=tmp_path, env={FAULT_ENV: "skip-bucket:1"})
    with srv as client:
        sender = client.init_weight_transfer("gloo", bucket_bytes=BUCKET_BYTES, server_pauses=True)
        assert sender.shared_memory
        with pytest.raises(SyncMismatch, match="did not land on inference rank 1"):
            client.update_weights(build_tiny_model(seed=1)[0].named_parameters(), version=5)


def test_the_receiver_maps_only_the_trainers_file_with_its_nonce(tmp_path):
    made = SharedSlots.create(4096)
    assert made is not None
    slots, nonce = made
    try:
        assert SharedSlots.open(slots.path, nonce, 4096) is not None
        assert SharedSlots.open(slots.path, "00" * 16, 4096) is None  # another run's file
        assert SharedSlots.open(slots.path, nonce, 8192) is None  # another bucket size
        assert SharedSlots.open(slots.path, "not hex", 4096) is None
        foreign = tmp_path / os.path.basename(slots.path)  # same bytes, outside /dev/shm
        foreign.write_bytes(open(slots.path, "rb").read())
        assert SharedSlots.open(str(foreign), nonce, 4096) is None
    finally:
        slots.unlink()
    assert SharedSlots.open(slots.path, nonce, 4096) is None  # gone
    # no room for two slots of 1 PB: declined, the sync stays on gloo
    assert SharedSlots.create(1 << 50) is None


def test_a_bucket_larger_than_a_slot_takes_every_path(tmp_path):
    """Weights of 1 MiB and more in 2 MiB buckets: the 3 MiB MLP weights come alone, larger than a slot. Each
    tensor lands in place (read-back checksums equal the trainer's): from a shared slot, from a bucket too large
    for a slot, and over gloo alone."""
    shape = dict(hidden=512, layers=2, head_dim=64, intermediate_size=1536)
    model, tok = build_tiny_model(**shape)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    bucket_bytes = 2 << 20
    metas = _metas(model)
    buckets = plan_buckets(metas, bucket_bytes)
    assert any(b.nbytes > bucket_bytes for b in buckets)
    srv = InferenceServer(str(tmp_path / "m"), engine="cpu", output_dir=tmp_path / "out")
    with srv as client:
        for version, shared in ((1, True), (2, False)):
            sender = client.init_weight_transfer(
                "gloo", bucket_bytes=bucket_bytes, server_pauses=True, shared_memory=shared
            )
            assert sender.shared_memory == shared
            new = build_tiny_model(**shape, seed=version)[0]
            client.update_weights(new.named_parameters(), version=version)  # verified: raises if not landed
            assert client.weight_version() == str(version)
