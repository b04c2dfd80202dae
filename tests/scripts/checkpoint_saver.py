"""Run by tests/e2e/test_reliability.py: checkpoints saved over and over, by processes the test kills with -9.

    python checkpoint_saver.py MODEL_DIR OUTPUT_DIR

One RLTrainer (tiny model, LoRA, optimizer and scheduler built, an orchestrator holding a generated batch) is set
up once; then, per line on stdin:

- `save`: fork a child that saves checkpoint after checkpoint (the trainer's own `_save_checkpoint`: staging,
  manifest, publish, rotation) from the step after the newest complete one, and print its pid. The test kills it.
- `save K`: fork a child that saves the newest step once more and SIGKILLs itself at the K-th file-system
  operation of the publish (the test's hook: it places the kill exactly; the kill is real).
- `check`: reap the child, then resume as `train(resume_from_checkpoint=True)` does (`_resume_point`, the model,
  optimizer, scheduler, trainer state and orchestrator state loaded) and print what was found, as JSON.

Forking keeps each round at milliseconds instead of an interpreter start; one torch thread keeps it fork-safe.
"""

import json
import os
import shutil
import signal
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from rl_envs import reverse_env  # noqa: E402

import verifiers_rl.trainer.trainer as trainer_module  # noqa: E402
from verifiers_rl.errors import TrainingError  # noqa: E402
from verifiers_rl.export.checkpoints import ORCHESTRATOR_STATE, STAGING, checkpoints  # noqa: E402
from verifiers_rl.rollouts.orchestrator import Orchestrator, RolloutBatch  # noqa: E402
from verifiers_rl.rollouts.rollouts import Rollout, Turn  # noqa: E402
from verifiers_rl.trainer import RLConfig, RLTrainer  # noqa: E402

PROTOCOL = "saver> "
model_dir, out = sys.argv[1], sys.argv[2]
args = RLConfig(output_dir=out, use_cpu=True, batch_size=8, rollouts_per_example=4, micro_batch_size=4,
                max_tokens=4, max_seq_len=96, max_steps=10_000, save_total_limit=2, report_to="none")  # fmt: skip
env = reverse_env()
trainer = RLTrainer(model=model_dir, env=env, args=args)
trainer.create_optimizer_and_scheduler(num_training_steps=args.max_steps)
orch = Orchestrator(env, trainer.train_rows, base_url="http://127.0.0.1:9/v1", model_name="m",
                    sampling_args=args.sampling_args, rollouts_per_example=4, prompts_per_batch=2)  # fmt: skip
rollout = Rollout(group=0, reward=1.0, turns=[Turn([1, 2, 3], [4, 5], [1, 1], [-0.5, -0.25])], is_truncated=False,
                  error=None, policy_version=0)  # fmt: skip
orch.load_state_dict({"ready": {7: RolloutBatch(7, [rollout] * 8, 0, 0.1)}})
trainer.runtime.orchestrator = orch


def reply(value) -> None:
    print(f"{PROTOCOL}{value}", flush=True)  # libraries print to stdout too (deepspeed's accelerator notice)


def newest_step() -> int:
    return int(checkpoints(out)[0].name.split("-")[1]) if checkpoints(out) else 0


def save_forever() -> None:
    step = newest_step()
    while True:
        step += 1
        trainer.state.global_step = step
        trainer._save_checkpoint(trainer.model, trial=None)


def save_again_and_die(k: int) -> None:
    """Save the newest step once more, over itself, and die by SIGKILL at the k-th file-system operation of its
    publish (a rename done, or a folder deletion one file in): where a kill between steps of a save falls."""
    calls = [0]
    real_rmtree, real_replace = shutil.rmtree, os.replace

    def die_at_k():
        calls[0] += 1
        if calls[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)

    def rmtree(path, *a, **kw):
        files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs] if os.path.isdir(path) else []
        if files and calls[0] + 1 == k:
            os.remove(files[0])  # the deletion is under way
        die_at_k()
        real_rmtree(path, *a, **kw)

    def replace(src, dst):
        real_replace(src, dst)
        die_at_k()

    def publish(staged, final):
        shutil.rmtree, os.replace = rmtree, replace
        try:
            real_publish(staged, final)
        finally:
            shutil.rmtree, os.replace = real_rmtree, real_replace

    real_publish = trainer_module.publish
    trainer_module.publish = publish
    trainer.state.global_step = newest_step()
    trainer._save_checkpoint(trainer.model, trial=None)


def check() -> dict:
    staging = os.path.join(out, STAGING)
    half = sorted(os.listdir(staging)) if os.path.isdir(staging) else []  # what the kill interrupted
    found = {"checkpoints": [p.name for p in checkpoints(out)], "interrupted": half}
    try:
        path = trainer._resume_point(True)  # the resume train(resume_from_checkpoint=True) runs
    except TrainingError as e:
        return {**found, "resumable": None, "error": str(e)}
    trainer._load_from_checkpoint(path)
    trainer._load_optimizer_and_scheduler(path)
    state = json.loads(open(os.path.join(path, "trainer_state.json")).read())
    saved = torch.load(os.path.join(path, ORCHESTRATOR_STATE), weights_only=False)
    ok = state["global_step"] == int(path.rsplit("-", 1)[1]) and 7 in saved["ready"]
    return {**found, "resumable": os.path.basename(path), "loaded": ok}


child = None
reply("ready")
for line in sys.stdin:
    command = line.strip()
    if command.startswith("save"):
        child = os.fork()
        if child == 0:
            try:
                save_forever() if command == "save" else save_again_and_die(int(command.split()[1]))
            finally:
                os._exit(1)
        reply(child)
    elif command == "check":
        os.waitpid(child, 0)
        reply(json.dumps(check()))
