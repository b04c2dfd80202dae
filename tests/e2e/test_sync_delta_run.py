"""Send only what changed (sync/delta.py) into a real CPU-engine server over HTTP and real gloo.

Full fine-tuning steps of the tiny model, synced in bf16: the first sync is whole, the next ones carry the changed
elements only and are verified like any sync (the server's read-back checksums of every whole tensor against the
trainer's); the trainer's snapshot equals its own wire-dtype weights, so the server holds them too. A server whose
version moved without the sender gets a whole sync; a corrupted delta stops the sync; an RLTrainer run with
sync_changed_only trains through it.
"""

from __future__ import annotations

import pytest
import torch
from rl_envs import reverse_env
from runs import tiny_rl_config

from verifiers_rl.serving.launcher import InferenceServer
from verifiers_rl.sync import delta
from verifiers_rl.sync.policy_weights import merged_stream
from verifiers_rl.sync.verify import SyncMismatch
from verifiers_rl.tiny import build_tiny_model
from verifiers_rl.trainer import RLTrainer

BUCKET_BYTES = 16 * 1024  # several buckets: an index and its values can land in two


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = InferenceServer(tiny_model_dir, engine="cpu", output_dir=tmp_path_factory.mktemp("delta"))
    srv.start()
    yield srv
    srv.stop()


def _step(model, opt, seed: int) -> None:
    ids = torch.randint(3, 200, (4, 24), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _wire(model) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in merged_stream(model, torch.bfloat16)}


def _sync(client, model, version):
    return client.update_weights(merged_stream(model, torch.bfloat16), version=version)


def test_full_finetuning_steps_sync_their_changes_only_and_land(server):
    client = server.client
    sender = client.init_weight_transfer("gloo", bucket_bytes=BUCKET_BYTES, server_pauses=True, changed_only=True)
    model = build_tiny_model(seed=5)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    whole = sum(t.numel() * 2 for t in _wire(model).values())
    assert _sync(client, model, 1).bytes == whole  # nothing to diff against yet
    sizes = []
    for version in (2, 3, 4):
        _step(model, opt, version)
        stats = _sync(client, model, version)  # verified: every whole tensor read back equals the trainer's
        sizes.append(stats.bytes)
        assert client.weight_version() == str(version)
        held = _wire(model)
        assert all(torch.equal(sender.changes.tensors[n], t) for n, t in held.items())
    assert 0 < max(sizes) < whole and min(sizes) < whole / 2, (sizes, whole)  # in bf16 most elements keep theirs
    _step(model, opt, 9)
    assert _sync(client, model, 5).bytes < whole
    # nothing trained: an empty delta, still verified
    assert _sync(client, model, 6).bytes == 0 and client.weight_version() == "6"


def test_a_server_on_another_version_gets_a_whole_sync(server):
    client = server.client
    client.init_weight_transfer("gloo", bucket_bytes=BUCKET_BYTES, server_pauses=True, changed_only=True)
    model = build_tiny_model(seed=6)[0]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    whole = sum(t.numel() * 2 for t in _wire(model).values())
    assert _sync(client, model, 10).bytes == whole
    client.post("/update_weight_version", {"new_version": "42"})  # moved without this sender
    _step(model, opt, 1)
    assert _sync(client, model, 11).bytes == whole
    _step(model, opt, 2)
    assert _sync(client, model, 12).bytes < whole


def test_a_corrupted_delta_fails_verification_and_the_next_sync_is_whole(server, monkeypatch):
    client = server.client
    sender = client.init_weight_transfer("gloo", bucket_bytes=BUCKET_BYTES, server_pauses=True, changed_only=True)
    model = build_tiny_model(seed=7)[0]
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    whole = sum(t.numel() * 2 for t in _wire(model).values())
    _sync(client, model, 20)
    _step(model, opt, 1)
    honest = delta.wire_items
    corrupted = []

    def corrupt(name, update):
        if isinstance(update, delta.Sparse) and not corrupted:  # one value of one delta, in transit
            corrupted.append(name)
            update = delta.Sparse(update.index, update.values.clone())
            update.values[0] += 1.0
        return honest(name, update)

    monkeypatch.setattr(delta, "wire_items", corrupt)
    with pytest.raises(SyncMismatch, match=r"did not land on inference rank 1: 1 tensor holds other bytes"):
        _sync(client, model, 21)
    assert corrupted
    assert sender.changes.version is None  # the server may hold anything: no delta against it
    monkeypatch.setattr(delta, "wire_items", honest)
    assert _sync(client, model, 21).bytes == whole


def test_a_step_that_trained_nothing_keeps_the_next_sync_a_delta(server):
    """PolicySync moves the server's version without moving weights after a step that trained nothing; the
    snapshot follows it, so the next sync still sends only the changes."""
    from verifiers_rl.sync.export import ReplicatedExport
    from verifiers_rl.sync.policy_sync import PolicySync

    client = server.client
    sender = client.init_weight_transfer("gloo", bucket_bytes=BUCKET_BYTES, server_pauses=True, changed_only=True)
    model = build_tiny_model(seed=6)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    export = ReplicatedExport(model, torch.bfloat16)
    policy = PolicySync()
    policy.attach(client, "merged", started_from=None)
    whole = sum(t.numel() * 2 for t in _wire(model).values())
    policy.sync(export, 1)
    assert sender.changes.version == 1
    assert policy.sync(export, 2, changed=False) == 0.0  # nothing trained: no transfer
    assert (client.weight_version(), sender.changes.version) == ("2", 2)
    _step(model, opt, 3)
    sizes = []
    send = sender.send
    sender.send = lambda tensors, version: sizes.append(stats := send(tensors, version)) or stats
    policy.sync(export, 3)
    assert 0 < sizes[0].bytes < whole  # a delta against version 2's (= version 1's) weights, and it landed
    assert client.weight_version() == "3"


def test_changed_only_is_refused_where_the_receiver_cannot_apply_it(server):
    with pytest.raises(ValueError, match="needs whole-weight sync over gloo or nccl, not 'adapter'"):
        server.client.init_weight_transfer("adapter", changed_only=True)


def test_a_full_finetuning_run_with_changed_only_trains_and_syncs(tiny_model_dir, tmp_path):
    args = tiny_rl_config(
        tmp_path,
        use_lora=False,
        max_steps=3,
        max_async_level=0,
        learning_rate=1e-4,
        sync_changed_only=True,
        keep_server=True,
    )
    trainer = RLTrainer(model=tiny_model_dir, env=reverse_env(), args=args)
    try:
        trainer.train()
        client = trainer.runtime.client
        assert client.weight_version() == "3"
        snapshot = client.sender.changes
        assert snapshot is not None and snapshot.version == 3
        assert snapshot.diffed == 2  # step 1 is a whole sync; steps 2 and 3 send their changes, verified
        export = dict(trainer.weight_export().stream("merged"))  # the trainer's wire-dtype weights
        assert set(export) == set(snapshot.tensors)
        assert all(torch.equal(snapshot.tensors[n], t) for n, t in export.items())
    finally:
        trainer.close()
