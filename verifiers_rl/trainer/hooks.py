"""The trainer's lifecycle hooks, one callback each, in the order the HF loop must run them.

Each hook checks the rank itself: only the main process owns the server, the orchestrator and the sync.
`on_train_begin` runs after `Trainer` restored a checkpoint, so the server gets the restored weights.
"""

from __future__ import annotations

import contextlib
import os

import torch
from transformers import TrainerCallback

from verifiers_rl.errors import ServerLost
from verifiers_rl.export.checkpoints import ORCHESTRATOR_STATE
from verifiers_rl.trainer.preemption import StepAbandoned


class StartInference(TrainerCallback):
    """Start (or reuse) the server and the orchestrator; restore in-flight batches from a checkpoint."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        t = self.trainer
        saved = None
        if t.resume_from:
            path = os.path.join(t.resume_from, ORCHESTRATOR_STATE)
            if os.path.exists(path):
                saved = torch.load(path, weights_only=False)
        with t.abandonable():  # a server that never comes up must not outlast SIGTERM
            t.runtime.start(
                t.accelerator.unwrap_model(t.model), t.processing_class, t.train_rows, state.global_step, saved
            )


class SyncWeights(TrainerCallback):
    """Send the policy to the server at the start and after every optimizer step (version = global step). Every
    rank calls in: under a sharded layout each takes part in gathering what rank 0 sends."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        with self.trainer.abandonable():  # nothing is trained yet: a signal may end the first sync
            self.trainer.sync_weights()

    def on_step_end(self, args, state, control, **kwargs):
        # One process: a signal may end the sync (an NCCL sync's watchdog aborts it at once:
        # sync/transport/watchdog.py); the step trained, and is logged and checkpointed as any step a signal follows.
        # Several: rank 0 must finish the commands the others follow (rank_zero.py), and the sync's own deadline
        # bounds it.
        alone = not self.trainer.rank_zero.several
        try:
            with self.trainer.abandonable() if alone else contextlib.nullcontext():
                sync_s = self.trainer.sync_weights(changed=self.trainer.trained_last_step)
        except StepAbandoned:  # only the server, stopped with the run, misses this step's weights
            control.should_save = control.should_training_stop = True
            return
        except ServerLost as e:  # on every rank: rank 0's sync failed, the others were told (rank_zero.py)
            # the step trained: it is logged and checkpointed as every step is, then the run stops with `e`;
            # batches waiting for this step's weights would never start: a resume generates them again
            self.trainer.server_lost = e
            self.trainer.runtime.stop_rollouts()
            control.should_save = control.should_training_stop = True
            return
        self.trainer.clock.add("sync", sync_s)
        if not state.is_world_process_zero:
            return
        metrics = self.trainer.step_metrics
        step_s = metrics.get("timing/step_s", 0.0) + sync_s
        metrics["timing/sync_s"] = sync_s
        metrics["timing/sync_frac"] = sync_s / step_s if step_s else 0.0


class SubmitRollouts(TrainerCallback):
    """Keep `max_async_level` + 1 rollout batches submitted ahead of the step being trained."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.trainer.runtime.submit_ahead(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.trainer.runtime.submit_ahead(state.global_step)
