"""Syncs broken on purpose are caught; good ones are not (the other sync tests all run through the same checks).

- A receiver that drops a bucket, or acknowledges a sync and loads nothing: real CPU servers whose gloo receive
  path honours the test-only $VF_TEST_SYNC_FAULT (`verify.dropped_buckets`); their checksums of what they hold
  differ from the trainer's, and the sync fails naming the tensors and bytes.
- Wrong bytes both sides agree on (the trainer's export corrupts what it sends), and a sender that moves nothing
  (as vLLM's NCCL communicator would without libnccl, which reports no checksums): the trainer's mismatch_kl
  guard stops the run right after that sync. The sharded variant (a wrongly gathered shard under ZeRO-3 and
  FSDP2) is in tests/e2e/test_sharded.py.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from peft_models import lora_model
from procs import run_command
from rl_envs import reverse_env
from runs import tiny_rl_config

from verifiers_rl.errors import TrainingError
from verifiers_rl.serving.launcher import InferenceServer
from verifiers_rl.sync.buckets import TensorMeta, plan_buckets
from verifiers_rl.sync.policy_weights import adapter_weights
from verifiers_rl.sync.verify import FAULT_ENV, SyncMismatch
from verifiers_rl.tiny import build_tiny_model
from verifiers_rl.trainer import RLTrainer

BUCKET_BYTES = 16 * 1024  # the tiny model in several buckets


@pytest.fixture(scope="module", params=["skip-bucket:2", "stale"])
def faulty(request, tiny_model_dir, tmp_path_factory):
    srv = InferenceServer(
        tiny_model_dir, engine="cpu", output_dir=tmp_path_factory.mktemp("faulty"), env={FAULT_ENV: request.param}
    )
    srv.start()
    srv.client.init_weight_transfer("gloo", bucket_bytes=BUCKET_BYTES)
    yield request.param, srv
    srv.stop()


def _metas(model) -> list[TensorMeta]:
    return [TensorMeta(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]


def test_a_receiver_that_loses_tensors_fails_the_sync_and_a_good_sync_passes(faulty):
    fault, server = faulty
    client = server.client
    served, other = build_tiny_model(seed=0)[0], build_tiny_model(seed=1)[0]
    buckets = plan_buckets(_metas(other), BUCKET_BYTES)
    assert len(buckets) > 3
    dropped = buckets[2].metas if fault.startswith("skip-bucket") else [m for b in buckets for m in b.metas]
    # a dropped tensor shows where the server still holds other bytes (the norms' ones are the same in both)
    params = dict(served.named_parameters())
    lost = [m for m in dropped if not torch.equal(params[m.name], other.get_parameter(m.name))]
    assert lost
    total = sum(m.nbytes for m in _metas(other))
    with pytest.raises(SyncMismatch) as err:
        client.update_weights(other.named_parameters(), version=5)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"weight sync to version 5 did not land on inference rank 1: {len(lost)} tensors hold ")
    assert f"other bytes than were sent ({lost[0].name}, " in line
    assert f"; {sum(m.nbytes for m in lost)} of the sync's {total} bytes, {len(_metas(other))} tensors)" in line
    assert client.weight_version() == "0"  # verified before /finish_weight_update: the version never moved
    # the check is of what the server holds: the weights it already has pass, whatever it drops
    client.update_weights(served.named_parameters(), version=6)
    assert client.weight_version() == "6"


def test_an_adapter_sync_that_installs_nothing_is_caught(faulty):
    fault, server = faulty
    if fault != "stale":
        pytest.skip("one adapter case: the receiver acknowledges and installs nothing")
    client = server.client
    client.init_weight_transfer("adapter", bucket_bytes=BUCKET_BYTES)
    weights = adapter_weights(lora_model(seed=0).eval())
    n = len(weights.tensors)
    with pytest.raises(SyncMismatch, match=f"did not land on inference rank 1: {n} tensors were never loaded"):
        client.update_weights(weights, version=7)


# ---------------------------------------------------------------------------------------------- whole runs


def test_the_cli_stops_at_the_sync_that_did_not_land_with_one_line(tiny_model_dir, tmp_path):
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(
        textwrap.dedent(f"""
            model = "{tiny_model_dir}"
            output_dir = "{tmp_path / "out"}"
            [env]
            id = "reverse-text"
            [env.args]
            num_train_examples = 16
            num_eval_examples = 4
            [inference]
            engine = "cpu"
            [trainer.args]
            max_steps = 3
            rollouts_per_example = 4
            batch_size = 8
            micro_batch_size = 4
            max_tokens = 8
            max_seq_len = 512
            log_completions = false
            max_async_level = 0
        """)
    )
    r, _ = run_command("vf-rl", "@", cfg, env={FAULT_ENV: "stale"}, timeout=600)
    assert r.returncode == 1, r.stderr[-3000:]
    errors = [x for x in r.stderr.splitlines() if x.startswith("vf-rl: error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    # the first sync that moved weights (a step with nothing to train moves none): the step after the last logged
    logged = [json.loads(x)["step"] for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    prefix = f"vf-rl: error: weight sync to version {max(logged, default=0) + 1} did not land on inference rank 1: "
    assert errors[0].startswith(prefix) and "hold other bytes than were sent" in errors[0], errors[0]


def _args(tmp_path, **kw):
    geometry = dict(micro_batch_size=4, max_steps=4, seed=3, max_async_level=0)
    return tiny_rl_config(tmp_path, **{**geometry, **kw})


def _train(model_dir, args) -> tuple[str | None, list[dict]]:
    """Train; the error that stopped the run (None: it finished) and the metrics of the steps it logged."""
    trainer = RLTrainer(model=model_dir, env=reverse_env(), args=args)
    try:
        trainer.train()
        error = None
    except TrainingError as e:
        error = str(e)
    finally:
        trainer.close()
    path = f"{args.output_dir}/metrics.jsonl"
    rows = [json.loads(x) for x in open(path).read().splitlines() if '"loss"' in x]
    return error, rows


def _corrupt_export(monkeypatch):
    """The trainer's export sends one half of every tensor where the other half belongs (one rank's shard twice)
    while its own weights stay right: the server checksums the same wrong bytes the trainer sent."""
    from verifiers_rl.sync.export import ReplicatedExport
    from verifiers_rl.sync.stream import WeightStream

    stream = ReplicatedExport.stream

    def wrong(self, kind, bucket_bytes=64 << 20):
        s = stream(self, kind, bucket_bytes)

        def produce():
            for name, t in s.produce():
                half = t.shape[0] // 2
                if half:
                    t = t.clone()
                    t[t.shape[0] - half :] = t[:half]
                yield name, t

        return WeightStream(s.metas, produce, s.peft_config, s.rank)

    monkeypatch.setattr(ReplicatedExport, "stream", wrong)


def _send_nothing(monkeypatch, finish: bool = True):
    """A sender that moves no byte and still finishes the update, so the server takes the new version number (an
    NCCL communicator that vLLM could not back with libnccl would: vLLM's own engine reports no checksums); with
    `finish=False` not even the version moves."""
    from verifiers_rl.serving.client import InferenceClient
    from verifiers_rl.sync.sender import SyncStats

    def update_weights(self, tensors, *, version):
        if finish:
            self.post("/finish_weight_update", {"weight_version": str(version)})
        return SyncStats(0, 0, 0, 0, version)

    monkeypatch.setattr(InferenceClient, "update_weights", update_weights)


@pytest.mark.parametrize(
    ("fault", "stop_step"),
    [(_corrupt_export, 2), (_send_nothing, 3), (lambda mp: _send_nothing(mp, finish=False), 3)],
    ids=["wrong-bytes-both-sides-agree-on", "sender-moves-nothing", "server-keeps-its-version"],
)
def test_the_mismatch_kl_guard_stops_the_run_right_after_the_sync(
    request, tiny_model_dir, tmp_path, monkeypatch, fault, stop_step
):
    fault(monkeypatch)
    error, rows = _train(tiny_model_dir, _args(tmp_path))
    assert error is not None and error.startswith(f"step {stop_step}: mismatch_kl "), (
        error,
        [(r["mismatch_kl"], r["policy_version"], r["async_lag"]) for r in rows],
    )
    said = " (its rollouts say version 0)" if "keeps" in request.node.name else ""
    assert f"right after the sync to version {stop_step - 1}{said} is above" in error and "\n" not in error
    assert [r["step"] for r in rows] == list(range(1, stop_step))  # the step that tripped is not logged
    assert rows[0]["mismatch_kl"] < 1e-9  # sampled from the model files: the server's weights were the trainer's


def test_the_guard_is_off_when_asked_and_quiet_on_a_good_run(tiny_model_dir, tmp_path, monkeypatch):
    error, rows = _train(tiny_model_dir, _args(tmp_path / "good", max_steps=3))
    assert error is None and all(r["mismatch_kl"] < 1e-9 for r in rows)
    _corrupt_export(monkeypatch)
    error, rows = _train(tiny_model_dir, _args(tmp_path / "off", max_steps=3, mismatch_kl_guard=0))
    assert error is None and [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["mismatch_kl"] > 1e-3 for r in rows[1:])  # the broken syncs were there to be caught
