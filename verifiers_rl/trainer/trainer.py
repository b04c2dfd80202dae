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
import signal
import sys
import time

import torch
from torch.utils.data import Dataset
from transformers import Trainer
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from verifiers_rl.batch.samples import PreparedBatch, prepare_batch
from verifiers_rl.config.reporting import wandb_login_problem
from verifiers_rl.config.rl_config import RLConfig
from verifiers_rl.config.sharding import (
    fsdp2_requested,
    load_sharded,
    sharded_model_error,
    size_zero3_buckets_on_cpu,
    take_over_fsdp,
)
from verifiers_rl.errors import ServerLost, TrainingError
from verifiers_rl.export.checkpoints import (
    MANIFEST,
    ORCHESTRATOR_STATE,
    STAGING,
    publish,
    recover_staged,
    resume_point,
    resuming,
    save_failed,
    write_manifest,
)
from verifiers_rl.rollouts.env_mix import as_environment
from verifiers_rl.rollouts.prompts import filter_run_prompts
from verifiers_rl.rollouts.reward_checks import check_dataset, check_reward_inputs, guard_rewards, training_dataset
from verifiers_rl.sync.export import WeightExport, weight_export
from verifiers_rl.sync.guard import MismatchGuard
from verifiers_rl.trainer import final
from verifiers_rl.trainer.callbacks import MetricsFileCallback, RichProgressCallback, adapt_integrations
from verifiers_rl.trainer.diagnose import EmptySteps, report_failures
from verifiers_rl.trainer.hooks import StartInference, SubmitRollouts, SyncWeights
from verifiers_rl.trainer.policy_step import run_microbatches
from verifiers_rl.trainer.preemption import PreemptionGuard, StepAbandoned, StopOnSignal
from verifiers_rl.trainer.rank_zero import RankZeroLeads
from verifiers_rl.trainer.runtime import InferenceRuntime
from verifiers_rl.trainer.settings_resume import SettingsResume
from verifiers_rl.trainer.sharded_checkpoints import FSDP2Checkpoints
from verifiers_rl.trainer.step_timing import StepClock, TimeOptimizer, decompose

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


class RLTrainer(SettingsResume, FSDP2Checkpoints, Trainer):
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
        from verifiers_rl.models import ensure_pad_token, get_model, get_tokenizer, master_weights, training_kwargs

        args = self._own_args(args, peft_config, model)
        model_arg = model
        model_path = model if isinstance(model, str) else getattr(model, "name_or_path", None)
        self.fsdp2 = fsdp2_requested(args)
        if self.fsdp2:
            take_over_fsdp(args)
        if isinstance(model, str):
            kw = training_kwargs(args.use_lora)  # float32 master weights for full fine-tuning
            model = load_sharded(model, args.use_liger, kw) if self.fsdp2 else get_model(model, args.use_liger, kw)
        elif self.fsdp2 and not getattr(model, "is_distributed_loading_by_transformers", False):
            raise sharded_model_error()
        if processing_class is None:
            if not model_path:
                raise ValueError("pass processing_class (the tokenizer) when model has no name_or_path")
            processing_class = get_tokenizer(model_path)
        ensure_pad_token(processing_class, model)
        model = self._wrap_lora(master_weights(model, args.use_lora), args)
        env = as_environment(env)  # a list / dict of environments or an EnvGroup: one mixture (env_mix.py)
        self.env = env
        self.model_path = model_path
        dataset = training_dataset(env)
        check_dataset(env, dataset)
        check_reward_inputs(env, dataset)
        guard_rewards(env)
        self.train_rows, self.prompts_filtered = filter_run_prompts(dataset, processing_class, args, env)
        self.runtime = InferenceRuntime(args, model_path, env)
        self.resume_from: str | None = None
        self.run_config: dict | None = None  # the config the run was started from (vf-rl: its TOML), for the card
        self.step_metrics: dict[str, float] = {}
        self.empty_steps = EmptySteps(args.max_empty_steps)
        self._seen_failures: set[str | None] = set()
        # only on-policy: with k >= 1 the sampler is legitimately up to k versions older (ratio 0: off)
        self.sync_guard = MismatchGuard(args.mismatch_kl_guard * (args.max_async_level == 0), args.mismatch_kl_floor)
        # a server started from the model path holds the trainer's weights until the first step
        self.runtime.from_files = model_path is not None and isinstance(model_arg, str)
        self.runtime.current = lambda: (self.weight_export(), self.state.global_step)  # for a replaced server
        self.trained_last_step = True
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self._guard: PreemptionGuard | None = None
        self.server_lost: ServerLost | None = None  # the sync after a step found the server gone for good
        hooks = [StartInference(self), SyncWeights(self), SubmitRollouts(self), StopOnSignal(lambda: self._guard)]
        hooks.append(self._time_steps())
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
        self.rank_zero = RankZeroLeads(self.weight_export, self.abandonable)
        if sized := size_zero3_buckets_on_cpu(self.accelerator, args.device):  # see sharding.ZERO3_SIZES
            logger.info("ZeRO-3 on CPU: %s not in the DeepSpeed config, sized by the model", ", ".join(sized))
        self.remove_callback(ProgressCallback)
        self.add_callback(RichProgressCallback(self))
        adapt_integrations(self.callback_handler.callbacks, self.args.output_dir)

    @staticmethod
    def _own_args(args: RLConfig | None, peft_config, model) -> RLConfig:
        """The trainer's own RLConfig, checked again (`RLConfig.derive`): the caller's object stays as they built
        it, whatever the run changes in the trainer's (FSDP2's take-over, Trainer's own settings). verifiers <= 0.1.6's
        GRPOTrainer(peft_config=...) wins over the lora_* fields. What cannot start fails here, before any loading."""
        args = args if args is not None else RLConfig()
        if not isinstance(args, RLConfig):
            raise TypeError(f"args must be an RLConfig, got {type(args).__name__}")
        if problem := wandb_login_problem(args):  # wandb.init would fail (or prompt) after the server started
            raise TrainingError(problem)
        if model == "tiny" and not os.path.exists(model):  # the TOML shorthand; as a hub id it fails far from here
            raise ValueError(
                "model='tiny' is vf-rl's config shorthand for the offline tiny model; in Python, build it first: "
                "`from verifiers_rl.tiny import save_tiny_model; model = str(save_tiny_model('outputs/tiny-model'))`"
            )
        return args.derive(**({"lora_config": peft_config, "use_lora": True} if peft_config is not None else {}))

    def _time_steps(self) -> TimeOptimizer:
        """The step's wall time by stage (step_timing.py; a new clock per train()); returns the optimizer's timer."""
        self.clock = StepClock()
        waits = self.runtime.policy.before_transfer  # a sync first waits for batches that need older weights

        def timed_wait(version: int) -> None:
            with self.clock.span("rollouts_wait"):  # this train()'s clock, looked up when the sync runs
                waits(version)

        self.runtime.policy.before_transfer = timed_wait
        return TimeOptimizer(self)

    @staticmethod
    def _wrap_lora(model, args: RLConfig):
        if not args.use_lora or hasattr(model, "peft_config"):
            return model
        from transformers import set_seed

        from verifiers_rl.config.lora import run_lora_config, wrap_lora

        set_seed(args.seed)  # LoRA A is random-initialised: seed it so runs (and ranks) start identically
        model = wrap_lora(model, run_lora_config(args))
        if args.activation_checkpointing:
            model.enable_input_require_grads()
        return model

    # ------------------------------------------------------------------ lifecycle

    def _start_wandb(self) -> None:
        """The run's `wandb` table (project, entity, tags, group, ...) as wandb.init's arguments: transformers'
        WandbCallback only passes a project from $WANDB_PROJECT and the run name, and reuses a run already open."""
        if not self.args.wandb or "wandb" not in self.args.report_to or not self.is_world_process_zero():
            return
        import wandb

        if wandb.run is None:
            wandb.init(**{"name": self.args.run_name, **self.args.wandb})

    def train(self, resume_from_checkpoint=None, *args, save_final: bool = True, **kwargs):
        """`Trainer.train`, plus: a checkpoint is checked before it is resumed from (the newest usable one with
        `True`); SIGTERM / Ctrl-C checkpoint the last completed step before the run ends (preemption.py), and so
        does a server that is lost for good (serving/recovery.py); a run that trained nothing raises; a run that
        finishes writes <output_dir>/final (`final_model`; `save_final=False` leaves that to the caller). A resume
        is checked against the settings the checkpoint was trained with first (settings_resume.py): changed ones
        raise one line, and a finished run trains nothing."""
        resume_from_checkpoint, finished = self.settled_resume(resume_from_checkpoint)
        if finished:
            return None
        resume = self._resume_point(resume_from_checkpoint)
        self.resume_from = resume
        self._start_wandb()
        self.clock = StepClock()
        guard = self._guard = PreemptionGuard(on_second_signal=self.runtime.kill_server)
        try:
            with guard:
                try:
                    self.empty_steps, self.server_lost = EmptySteps(self.args.max_empty_steps), None
                    result = super().train(resume, *args, **kwargs)
                    if self.server_lost is not None:  # after a sync: that step was logged and checkpointed
                        raise self.server_lost
                    if guard.signum is None:
                        self.empty_steps.check_trained()
                except StepAbandoned:
                    result = None
                    self._save_after_signal()
                except ServerLost:
                    # the server is gone for good while a step waited for rollouts: that step is dropped (the
                    # resume the error asks for generates it again); the last completed one is kept
                    self.runtime.stop_rollouts()
                    self._save_after_signal()
                    raise
            if guard.signum is not None:
                self._say_stopped(guard.signum)
                self.close()
                guard.raise_for_signal()
        finally:
            self._guard = None
            self.runtime.stop_rollouts()
            if not self.args.keep_server:  # a notebook kernel must not hold a server (or its GPU memory) idle
                self.runtime.close()
        if save_final:
            self.save_final()
        return result

    def _resume_point(self, requested):
        if not requested:
            return None
        if self.is_world_process_zero():  # what a save killed at its very end left whole is kept
            for note in recover_staged(self.args.output_dir):
                logger.warning(note)
        self.accelerator.wait_for_everyone()
        try:
            resume, notes = resume_point(
                self.args.output_dir, requested, use_lora=self.args.use_lora, save_only_model=self.args.save_only_model
            )
        except ValueError as e:
            raise TrainingError(str(e)) from None
        for note in notes:
            logger.warning(note)
        if self.is_world_process_zero():
            plan = self.resume_plan
            how = plan.how() if plan and plan.checkpoint == resume else ""
            resuming(self.args.output_dir, resume, self.args.max_steps, how)
        return resume

    def _say_stopped(self, signum: int) -> None:
        """Where a run stopped by SIGTERM / Ctrl-C stands: the checkpoint it saved and how to resume from it."""
        step = self.state.global_step
        if not self.is_world_process_zero():
            return
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        if step == 0:
            print(f"verifiers-rl: stopped by {name} before the first step: nothing to save", file=sys.stderr)
            return
        where = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        print(
            f"verifiers-rl: stopped by {name} after step {step}: {where} is saved; run the same command again "
            "(train(resume_from_checkpoint=True) in Python) to resume from it",
            file=sys.stderr,
            flush=True,
        )

    def _save_after_signal(self) -> None:
        """The step that was waiting for rollouts is dropped; checkpoint the last completed one (unless a
        scheduled save just did)."""
        step = self.state.global_step
        done = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}", MANIFEST)
        if step > 0 and not os.path.exists(done):
            self._save_checkpoint(self.model, trial=None)

    def save_final(self) -> str | None:
        """Write <output_dir>/final: the trained model (LoRA merged, and the adapter on its own), tokenizer and
        a model card with the evaluations logged so far and the reward curve; pushed when push_to_hub (final.py)."""
        out = final.save_final(self)
        return str(out) if out is not None else None

    def init_hf_repo(self, token=None, private=None) -> None:
        # Trainer creates the hub repository at init; here nothing reaches the hub before there is a model
        self.push_in_progress = None

    def _push_from_checkpoint(self, checkpoint_folder) -> None:
        pass  # checkpoints stay local: push_to_hub pushes final/ when the run ends

    def push_to_hub(self, commit_message=None, blocking=True, token=None, revision=None, private=None, **kwargs):
        """Upload <output_dir>/final (written first if it is not there) to `hub_model_id`; every process calls it."""
        return final.push_final(self, commit_message=commit_message, token=token, revision=revision, private=private)

    def close(self) -> None:
        """Stop rollouts and the inference server this trainer spawned (evaluate() or train() start one again)."""
        self.runtime.close()

    def __enter__(self) -> RLTrainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def sync_weights(self, changed: bool = True) -> float:
        """Make the server serve policy version = global step (`PolicySync` decides whether weights move). Called
        on every rank: rank 0 syncs (replacing a server that died, serving/recovery.py); under a sharded layout the
        others walk each stream rank 0 opens, gathering what it sends (`ShardedExport.stream`)."""
        version = self.state.global_step
        return self.rank_zero.run(lambda: self.runtime.sync(self.weight_export(), version, changed))

    def weight_export(self) -> WeightExport:
        """The training model as the server and the loss read it, for its parallel layout (sync/export.py)."""
        return weight_export(self.model, self.accelerator, self.rank_zero)

    def abandonable(self):
        """A wait SIGTERM / Ctrl-C may end at once (see PreemptionGuard.abandonable); outside train(): none."""
        return self._guard.abandonable() if self._guard else contextlib.nullcontext()

    # ------------------------------------------------------------------ one step

    def training_step(self, model, inputs, num_items_in_batch=None):
        t0 = time.perf_counter()
        self.clock.start()
        prepared: PreparedBatch = self.rank_zero.run(lambda: self._next_batch(t0), abandonable=True)
        self._stop_when_nothing_trains(prepared)
        self.trained_last_step = prepared.num_sequences > 0  # no sample: the weights do not move
        t_train = time.perf_counter()
        model.train()
        loss, metrics = run_microbatches(
            self.accelerator, model, prepared, self.args, self.processing_class.pad_token_id
        )
        metrics.update(prepared.metrics)
        # a batch trained again (num_iterations) was sampled before the steps since: its sampler legitimately differs
        if not metrics["batch_iteration"] and (problem := self.sync_guard.check_batch(self.state.global_step, metrics)):
            raise TrainingError(problem)  # a sync that did not land (sync/guard.py)
        metrics["timing/train_s"] = time.perf_counter() - t_train
        metrics["timing/step_s"] = time.perf_counter() - t0
        metrics["tokens_per_s"] = metrics.get("tokens", 0.0) / max(metrics["timing/step_s"], 1e-9)
        metrics["prompts_filtered"] = float(self.prompts_filtered + self.runtime.prompts_filtered)
        self.step_metrics = metrics
        self.clock.add("train", metrics["timing/train_s"])
        self.clock.open("optimizer")  # closed after optimizer.step() (TimeOptimizer)
        # each rank holds a partial sum of a globally normalised loss; Trainer logs the mean over ranks
        return loss.detach() * self.accelerator.num_processes

    def _next_batch(self, t0: float) -> PreparedBatch:
        """Rank 0: this step's batch from the server, prepared for every rank (`rank_zero.run` hands it out)."""
        args: RLConfig = self.args
        with self.abandonable(), self.clock.span("rollouts_wait"):
            batch = self.runtime.next_batch(self.state.global_step)
        prepared = prepare_batch(batch.rollouts, args, self.state.global_step, self.processing_class)
        iteration = self.state.global_step % args.num_iterations  # > 0: a batch trained again (num_iterations)
        prepared.metrics["timing/generation_s"] = 0.0 if iteration else batch.generation_seconds
        prepared.metrics["batch_iteration"] = float(iteration)
        prepared.metrics["policy_version"] = float(batch.policy_version)  # the weights the batch was sampled with
        prepared.metrics.update(batch.filter_metrics or {})  # online_difficulty_filtering (difficulty_filter.py)
        prepared.metrics["timing/wait_s"] = time.perf_counter() - t0
        prepared.metrics["server_restarts"] = float(self.runtime.recovery.total)
        step = self.state.global_step + 1  # as metrics.jsonl numbers it
        report_failures(
            batch.rollouts,
            prepared,
            step,
            self._seen_failures,
            self.args,
            self.processing_class,
            self.env,
            self.runtime.max_model_len,
        )
        return prepared

    def _stop_when_nothing_trains(self, prepared: PreparedBatch) -> None:
        """Every rank: count steps without a trainable sample; stop with the cause after max_empty_steps of them in
        a row, or at once when every rollout failed with one configuration error (a run that trains nothing must
        not end as a success; `train()` checks the whole run at its end)."""
        step = self.state.global_step + 1  # the step being trained, as metrics.jsonl numbers it
        warning = self.empty_steps.record(step, prepared, prepared.config_error)
        if warning and self.is_world_process_zero():
            logger.warning(warning)

    def floating_point_ops(self, inputs) -> int:
        return 0  # inputs are step markers; FLOPs are not tracked

    # ------------------------------------------------------------------ logging, checkpoints, eval

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.step_metrics:
            wall, stages = self.clock.lap()  # the steps since the last log line (one at logging_steps 1)
            generation = self.step_metrics.get("timing/generation_s", 0.0)
            logs = {**logs, **self.step_metrics, **decompose(wall, stages, generation)}
            self.step_metrics = {}
        super().log(logs, start_time)

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint written into a staging folder, completed with the orchestrator's state and a
        manifest, then renamed into place (checkpoints.py): a kill mid-save leaves no half checkpoint."""
        final_root = self._get_output_dir(trial=trial)
        staging_root = os.path.join(final_root, STAGING)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        self._get_output_dir = lambda trial=None: staging_root  # where Trainer writes this one checkpoint
        staged = os.path.join(staging_root, name)
        try:
            with self.clock.span("checkpoint"):
                super()._save_checkpoint(model, trial)
                if self.is_world_process_zero():
                    if self.runtime.orchestrator is not None:
                        timeout = self.args.save_on_signal_timeout if self._guard and self._guard.signum else None
                        state = self.runtime.rollout_state(self.state.global_step, timeout=timeout)
                        torch.save(state, os.path.join(staged, ORCHESTRATOR_STATE))
                    final.write_run_info(self, staged)  # what `vf-rl export` needs to describe this checkpoint
                    write_manifest(staged, self.state.global_step)
        except OSError as e:
            full = save_failed(e, staged, final_root)  # a full disk: one line, the staged half removed
            if full is None:
                raise
            raise full from None
        finally:
            del self._get_output_dir
        self.accelerator.wait_for_everyone()
        if self.is_world_process_zero():
            publish(staged, os.path.join(final_root, name))
            rotate_checkpoints(
                output_dir=final_root,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
            )
        self.accelerator.wait_for_everyone()

    def evaluate(
        self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval", temperature: float | None = None
    ) -> dict[str, float]:
        """Rollouts on the environment's eval split with the current policy, at `temperature` (None: the config's
        eval_temperature; [eval] greedy asks for 0). Only the main process talks to the server (the others would
        start or re-initialise one); every process gets the same metrics."""
        model = self.accelerator.unwrap_model(self.model)
        with self.clock.span("eval"):  # scheduled work, not the framework's share of the step it follows
            if self.is_world_process_zero():
                self.runtime.ensure_server(model, self.processing_class, self.state.global_step)
            self.sync_weights()  # every rank: a sharded model's sync gathers on all of them
            metrics = self.rank_zero.run(
                lambda: self.runtime.evaluate(self.processing_class, metric_key_prefix, temperature)
            )
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics
