"""RLTrainer: a `transformers.Trainer` that owns an inference server and trains a policy on grouped rollouts.

One optimizer step per rollout batch. `training_step` runs the batch's micro-batches itself (token-budget
micro-batches, packed or length-bucketed); the Trainer around it keeps doing what it does well: optimizer,
scheduler, clipping, logging integrations, checkpoints with optimizer/scheduler/RNG state, callbacks.
After each step the new weights go to the server and the next rollout batch is submitted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time

import torch
from accelerate.utils import broadcast_object_list
from torch.utils.data import Dataset
from transformers import Trainer
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from verifiers_rl.errors import TrainingError
from verifiers_rl.rl.trainer.callbacks import MetricsFileCallback, RichProgressCallback
from verifiers_rl.rl.trainer.checkpoints import (
    MANIFEST,
    ORCHESTRATOR_STATE,
    STAGING,
    drop_metrics_after,
    publish,
    resume_point,
    write_manifest,
)
from verifiers_rl.rl.trainer.config import RLConfig
from verifiers_rl.rl.trainer.diagnose import explain_empty_step, first_error
from verifiers_rl.rl.trainer.hooks import StartInference, SubmitRollouts, SyncWeights
from verifiers_rl.rl.trainer.policy_step import run_microbatches
from verifiers_rl.rl.trainer.preemption import PreemptionGuard, StepAbandoned, StopOnSignal
from verifiers_rl.rl.trainer.prompts import filter_prompts
from verifiers_rl.rl.trainer.reward_checks import check_dataset, check_reward_inputs, guard_rewards
from verifiers_rl.rl.trainer.runtime import InferenceRuntime
from verifiers_rl.rl.trainer.samples import PreparedBatch, prepare_batch
from verifiers_rl.rl.trainer.sharded_checkpoints import FSDP2Checkpoints
from verifiers_rl.rl.trainer.sharding import fsdp2_requested, load_sharded, sharded_model_error, take_over_fsdp
from verifiers_rl.rl.trainer.sync_guard import MismatchGuard
from verifiers_rl.rl.trainer.weight_export import WeightExport, weight_export

logger = logging.getLogger(__name__)


class _Steps(Dataset):
    """One dummy item per optimizer step and process: the real data comes from the orchestrator."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"step": i}


def _collate(items):
    return {"vf_rl_step": torch.tensor([it["step"] for it in items])}


class RLTrainer(FSDP2Checkpoints, Trainer):
    def __init__(
        self,
        model,
        env,
        args: RLConfig | None = None,
        processing_class=None,
        callbacks=None,
        peft_config=None,
        **kwargs,
    ):
        from verifiers_rl.models import ensure_pad_token, get_model, get_tokenizer

        args = args if args is not None else RLConfig()
        if not isinstance(args, RLConfig):
            raise TypeError(f"args must be an RLConfig, got {type(args).__name__}")
        if peft_config is not None:  # verifiers <= 0.1.6's GRPOTrainer(peft_config=...): wins over the lora_* fields
            args.lora_config, args.use_lora = peft_config, True
        model_arg = model
        model_path = model if isinstance(model, str) else getattr(model, "name_or_path", None)
        self.fsdp2 = fsdp2_requested(args)
        if self.fsdp2:
            take_over_fsdp(args)
        if isinstance(model, str):
            model = load_sharded(model, args.use_liger) if self.fsdp2 else get_model(model, use_liger=args.use_liger)
        elif self.fsdp2 and not getattr(model, "is_distributed_loading_by_transformers", False):
            raise sharded_model_error()
        if processing_class is None:
            if not model_path:
                raise ValueError("pass processing_class (the tokenizer) when model has no name_or_path")
            processing_class = get_tokenizer(model_path)
        ensure_pad_token(processing_class, model)
        model = self._wrap_lora(model, args)
        self.env = env
        self.model_path = model_path
        dataset = env.get_dataset()
        check_dataset(env, dataset)
        check_reward_inputs(env, dataset)
        guard_rewards(env)
        self.train_rows, self.prompts_filtered = filter_prompts(dataset, processing_class, args.prompt_limit, env)
        self.runtime = InferenceRuntime(args, model_path, env)
        self.resume_from: str | None = None
        self.step_metrics: dict[str, float] = {}
        self._empty_steps = 0
        self._seen_failures: set[str | None] = set()
        self.sync_guard = MismatchGuard(args.mismatch_kl_guard, args.mismatch_kl_floor)
        # a server started from the model path holds the trainer's weights until the first step
        self.runtime.from_files = model_path is not None and isinstance(model_arg, str)
        self.trained_last_step = True
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self._guard: PreemptionGuard | None = None
        hooks = [StartInference(self), SyncWeights(self), SubmitRollouts(self), StopOnSignal(lambda: self._guard)]
        callbacks = [*hooks, MetricsFileCallback(), *(callbacks or [])]
        # Trainer refuses to checkpoint the optimizer of a model sharded at load time unless it saves weights only;
        # this trainer checkpoints it itself (sharded_checkpoints.py), so the refusal is stepped around for init
        only, args.save_only_model = args.save_only_model, args.save_only_model or self.fsdp2
        super().__init__(
            model=model,
            args=args,
            processing_class=processing_class,
            train_dataset=_Steps(args.max_steps * world),
            eval_dataset=_Steps(1) if args.eval_strategy != "no" else None,
            data_collator=_collate,
            callbacks=callbacks,
            **kwargs,
        )
        args.save_only_model = only
        self.remove_callback(ProgressCallback)
        self.add_callback(RichProgressCallback(self))

    @staticmethod
    def _wrap_lora(model, args: RLConfig):
        if not args.use_lora or hasattr(model, "peft_config"):
            return model
        from peft import get_peft_model
        from transformers import set_seed

        from verifiers_rl.rl.trainer.lora import run_lora_config

        set_seed(args.seed)  # LoRA A is random-initialised: seed it so runs (and ranks) start identically
        model = get_peft_model(model, run_lora_config(args))
        if args.gradient_checkpointing:
            model.enable_input_require_grads()
        return model

    # ------------------------------------------------------------------ lifecycle

    def train(self, resume_from_checkpoint=None, **kwargs):
        """`Trainer.train`, plus: a checkpoint is checked before it is resumed from (the newest usable one with
        `True`), and SIGTERM / Ctrl-C checkpoint the last completed step before the run ends (preemption.py)."""
        resume = self._resume_point(resume_from_checkpoint)
        self.resume_from = resume
        guard = self._guard = PreemptionGuard(on_second_signal=self.runtime.kill_server)
        try:
            with guard:
                try:
                    result = super().train(resume_from_checkpoint=resume, **kwargs)
                except StepAbandoned:
                    result = None
                    self._save_after_signal()
            if guard.signum is not None:
                logger.warning("stopped by signal %d after step %d", guard.signum, self.state.global_step)
                self.close()
                guard.raise_for_signal()
            return result
        finally:
            self._guard = None
            self.runtime.stop_rollouts()
            if not self.args.keep_server:  # a notebook kernel must not hold a server (or its GPU memory) idle
                self.runtime.close()

    def _resume_point(self, requested):
        if not requested:
            return None
        try:
            resume, notes = resume_point(
                self.args.output_dir, requested, use_lora=self.args.use_lora, save_only_model=self.args.save_only_model
            )
        except ValueError as e:
            raise TrainingError(str(e)) from None
        for note in notes:
            logger.warning(note)
        if self.is_world_process_zero():
            drop_metrics_after(self.args.output_dir, int(resume.rsplit("-", 1)[1]))
            shutil.rmtree(os.path.join(self.args.output_dir, STAGING), ignore_errors=True)  # a save that was killed
        return resume

    def _save_after_signal(self) -> None:
        """The step that was waiting for rollouts is dropped; checkpoint the last completed one (unless a
        scheduled save just did)."""
        step = self.state.global_step
        done = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}", MANIFEST)
        if step > 0 and not os.path.exists(done):
            self._save_checkpoint(self.model, trial=None)

    def close(self) -> None:
        """Stop rollouts and the inference server this trainer spawned (evaluate() or train() start one again)."""
        self.runtime.close()

    def __enter__(self) -> RLTrainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def sync_weights(self, changed: bool = True) -> float:
        """Make the server serve policy version = global step (`PolicySync` decides whether weights move). Called
        on every rank: rank 0 syncs; under a sharded layout the others iterate the same stream, which gathers
        what rank 0 sends, when rank 0 says weights move."""
        export, version = self.weight_export(), self.state.global_step
        rank0 = self.is_world_process_zero()
        if not export.collective:
            return self.runtime.sync(export, version, changed) if rank0 else 0.0
        policy = self.runtime.policy
        decision = [(policy.needs_transfer(version, changed), policy.weights, policy.bucket_bytes) if rank0 else None]
        broadcast_object_list(decision, from_process=0)
        if rank0:
            return self.runtime.sync(export, version, changed)
        moves, kind, bucket_bytes = decision[0]
        if moves:
            export.stream(kind, bucket_bytes).drain()
        return 0.0

    def weight_export(self) -> WeightExport:
        """The training model as the server and the loss read it, for its parallel layout (weight_export.py)."""
        return weight_export(self.model, self.accelerator)

    # ------------------------------------------------------------------ one step

    def training_step(self, model, inputs, num_items_in_batch=None):
        args: RLConfig = self.args
        t0 = time.perf_counter()
        payload = [None]
        if self.is_world_process_zero():
            with self._guard.waiting_for_rollouts() if self._guard else contextlib.nullcontext():
                batch = self.runtime.next_batch(self.state.global_step)
            prepared = prepare_batch(batch.rollouts, args, current_version=self.state.global_step)
            prepared.metrics["timing/generation_s"] = batch.generation_seconds
            prepared.metrics["policy_version"] = float(batch.policy_version)  # the weights the batch was sampled with
            prepared.metrics["timing/wait_s"] = time.perf_counter() - t0
            self._report_failures(batch.rollouts, prepared)
            payload = [prepared]
        if self.accelerator.num_processes > 1:
            with self._guard.waiting_for_rollouts() if self._guard else contextlib.nullcontext():
                broadcast_object_list(payload, from_process=0)
        prepared: PreparedBatch = payload[0]
        self._stop_when_nothing_trains(prepared)
        self.trained_last_step = prepared.num_sequences > 0  # no sample: the weights do not move
        t_train = time.perf_counter()
        model.train()
        loss, metrics = run_microbatches(
            self.accelerator, model, prepared, self.args, self.processing_class.pad_token_id
        )
        metrics.update(prepared.metrics)
        self._check_sync(prepared, metrics)
        metrics["timing/train_s"] = time.perf_counter() - t_train
        metrics["timing/step_s"] = time.perf_counter() - t0
        metrics["tokens_per_s"] = metrics.get("tokens", 0.0) / max(metrics["timing/step_s"], 1e-9)
        metrics["prompts_filtered"] = float(self.prompts_filtered)
        self.step_metrics = metrics
        # each rank holds a partial sum of a globally normalised loss; Trainer logs the mean over ranks
        return loss.detach() * self.accelerator.num_processes

    def _report_failures(self, rollouts, prepared: PreparedBatch) -> None:
        """Rank 0: say once per distinct cause that rollouts were rejected or errored; explain an empty step."""
        for kind in ("rejected", "errored"):
            n = int(prepared.counts.get(f"rollouts_{kind}", 0))
            text = first_error(rollouts, kind)
            if n and text not in self._seen_failures:
                self._seen_failures.add(text)
                step = self.state.global_step
                logger.warning("step %d: %d of %d rollouts %s (first: %s)", step, n, len(rollouts), kind, text)
        if prepared.num_sequences == 0:
            prepared.problem = explain_empty_step(
                rollouts, prepared.counts, self.args, self.processing_class, self.env, self.runtime.max_model_len
            )

    def _check_sync(self, prepared: PreparedBatch, metrics: dict[str, float]) -> None:
        """Every rank (the metrics are reduced over ranks, so all decide alike): at max_async_level = 0, stop when
        the batch sampled after the last sync disagrees with the trainer far beyond this run's noise (sync_guard.py)."""
        if self.args.max_async_level != 0:
            return
        version, step = self.state.global_step, self.state.global_step + 1
        served = version - int(prepared.metrics.get("async_lag", 0))  # the version the server tagged rollouts with
        trained = metrics.get("trained_tokens", 0.0) > 0
        problem = self.sync_guard.check(step, metrics.get("mismatch_kl"), version, trained, served)
        if problem:
            raise TrainingError(problem)

    def _stop_when_nothing_trains(self, prepared: PreparedBatch) -> None:
        """Every rank: count consecutive steps without a trainable sample; stop with the cause after
        max_empty_steps of them (a run that trains nothing must not end as a success)."""
        if prepared.num_sequences:
            self._empty_steps = 0
            return
        self._empty_steps += 1
        limit = self.args.max_empty_steps
        if self._empty_steps >= limit:
            raise TrainingError(f"{self._empty_steps} consecutive steps had nothing to train: {prepared.problem}")
        if self.is_world_process_zero():
            step, problem = self.state.global_step, prepared.problem
            logger.warning("step %d has nothing to train (%d of %d): %s", step, self._empty_steps, limit, problem)

    def floating_point_ops(self, inputs) -> int:
        return 0  # inputs are step markers; FLOPs are not tracked

    # ------------------------------------------------------------------ logging, checkpoints, eval

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.step_metrics:
            logs = {**logs, **self.step_metrics}
            self.step_metrics = {}
        super().log(logs, start_time)

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint written into a staging folder, completed with the orchestrator's state and a
        manifest, then renamed into place (checkpoints.py): a kill mid-save leaves no half checkpoint."""
        final_root = self._get_output_dir(trial=trial)
        staging_root = os.path.join(final_root, STAGING)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        self._get_output_dir = lambda trial=None: staging_root  # where Trainer writes this one checkpoint
        try:
            super()._save_checkpoint(model, trial)
        finally:
            del self._get_output_dir
        staged = os.path.join(staging_root, name)
        if self.is_world_process_zero():
            if self.runtime.orchestrator is not None:
                timeout = self.args.save_on_signal_timeout if self._guard and self._guard.signum else None
                state = self.runtime.rollout_state(timeout=timeout)
                torch.save(state, os.path.join(staged, ORCHESTRATOR_STATE))
            write_manifest(staged, self.state.global_step)
        self.accelerator.wait_for_everyone()
        if self.is_world_process_zero():
            publish(staged, os.path.join(final_root, name))
            rotate_checkpoints(
                output_dir=final_root,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
            )
        self.accelerator.wait_for_everyone()

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Rollouts on the environment's eval split with the current policy. Only the main process talks to the
        server (the others would start or re-initialise one); every process gets the same metrics."""
        payload = [None]
        model = self.accelerator.unwrap_model(self.model)
        if self.is_world_process_zero():
            self.runtime.ensure_server(model, self.processing_class, self.state.global_step)
        self.sync_weights()  # every rank: a sharded model's sync gathers on all of them
        if self.is_world_process_zero():
            metrics = self.runtime.evaluate(
                model, self.processing_class, self.weight_export(), metric_key_prefix, self.state.global_step
            )
            payload = [metrics]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(payload, from_process=0)
        metrics = payload[0]
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics
