"""Run by tests/e2e/test_sharded.py: a few RL steps of the tiny model, alone or under a launcher (DDP, DeepSpeed
ZeRO-3, FSDP2), then the weights the server would load, as rank 0 sees them after a sync (the merged stream).

    python sharded_train.py MODEL_DIR OUT_DIR {lora,full} [--resume] [--wrong-shard] [--kill-server]

`--wrong-shard` breaks the sharded export on purpose: every gathered tensor's second half is a copy of its first,
as if each rank had received rank 0's shard. The training model stays right; only what a sync sends is wrong.
`--kill-server` kills the server (SIGKILL, from rank 0) twice: right after step 1's optimizer step, so the sync to
version 1 fails, and right after step 2's sync, while the batch of step 3 generates; layout.json then records the
version the last server itself reports (/weight_info), its pid and the restarts.
"""

import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rl_envs import reverse_env  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from verifiers_rl.sync import export as weight_export
from verifiers_rl.trainer import RLConfig, RLTrainer  # noqa: E402

model_dir, out, policy = sys.argv[1], sys.argv[2], sys.argv[3]
resume = "--resume" in sys.argv


def _wrong(t):
    t = t.detach().clone()  # the export hands out live parameters and reused buffers: never write into them
    flat, half = t.view(-1), t.numel() // 2
    flat[t.numel() - half :] = flat[:half]
    return t


def gathered_wrong(gathered):
    @contextlib.contextmanager
    def wrong(self, names):
        with gathered(self, names) as full:
            yield {name: _wrong(t) for name, t in full.items()}

    return wrong


def start_wrong(start):
    """The sync's path: whole tensors on rank 0 (`ShardedExport._start`)."""

    def wrong(self, names, ring, index):
        wait = start(self, names, ring, index)
        return lambda: {name: _wrong(t) for name, t in wait().items()}

    return wrong


class KillTheServer(TrainerCallback):
    """Runs after the trainer's own hooks: at on_step_end the step's sync is done and the next batch submitted."""

    def __init__(self):
        self.killed = []

    def _kill(self):
        if trainer.is_world_process_zero():
            self.killed.append(trainer.runtime.session.process.process.pid)
            os.kill(self.killed[-1], signal.SIGKILL)

    def on_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step == 0:  # step 1 trained, its sync not started: the sync meets a dead server
            self._kill()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:  # synced to version 2; step 3's batch generates against the server
            self._kill()


if "--wrong-shard" in sys.argv:
    for cls in (weight_export.ZeRO3Export, weight_export.FSDP2Export):
        cls.gathered = gathered_wrong(cls.gathered)
    weight_export.ShardedExport._start = start_wrong(weight_export.ShardedExport._start)
lora = policy == "lora"
args = RLConfig(
    output_dir=out,
    rollouts_per_example=4,
    batch_size=16,
    micro_batch_size=4,
    max_steps=3,
    max_tokens=6,
    max_seq_len=96,
    max_prompt_len=64,
    learning_rate=5e-3 if lora else 2e-4,
    use_lora=lora,
    lora_rank=4,
    lora_alpha=8,
    use_cpu=True,
    seed=3,
    save_strategy="steps",
    save_steps=2,
    max_async_level=0,
    log_completions=False,
    sync_bucket_mb=1,  # several gather groups and buckets even for the tiny model
    server_mode="spawn",  # its own server, whatever listens on port 8000
    keep_server="--kill-server" in sys.argv,  # until trainer.close(): its version is read after the run
)
killer, served = KillTheServer(), {}
callbacks = [killer] if "--kill-server" in sys.argv else []
trainer = RLTrainer(model=model_dir, env=reverse_env(), args=args, callbacks=callbacks)
try:
    trainer.train(resume_from_checkpoint=True if resume else None)
    if "--kill-server" in sys.argv and trainer.is_world_process_zero():  # the server's answer, not our counter
        served = {"server_version": trainer.runtime.client.weight_version(), "killed": killer.killed,
                  "server_pid": trainer.runtime.session.process.process.pid,
                  "restarts": trainer.runtime.recovery.total}  # fmt: skip
    # rank 0 keeps what a sync would send; the other ranks join a sharded export's walk (RankZeroLeads.run)
    weights = {}
    stream = trainer.weight_export().stream("merged", 1 << 20)
    trainer.rank_zero.run(lambda: weights.update((name, t.detach().clone()) for name, t in stream))
finally:
    trainer.close()
if trainer.is_world_process_zero():
    torch.save(weights, f"{out}/weights.pt")
    layout = type(trainer.weight_export()).__name__
    print("LAYOUT", layout, "WORLD", trainer.accelerator.num_processes)
    info = {"export": layout, "world": trainer.accelerator.num_processes, **served}
    (Path(out) / "layout.json").write_text(json.dumps(info))
