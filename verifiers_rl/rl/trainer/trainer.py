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
import time
from collections import defaultdict

import torch
from accelerate.utils import broadcast_object_list
from torch.utils.data import Dataset
from transformers import Trainer
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from verifiers_rl.errors import TrainingError
from verifiers_rl.rl.trainer.callbacks import MetricsFileCallback, RichProgressCallback
from verifiers_rl.rl.trainer.config import RLConfig
from verifiers_rl.rl.trainer.diagnose import explain_empty_step, first_error
from verifiers_rl.rl.trainer.forward import output_head, reference_logprobs, token_logprobs
from verifiers_rl.rl.trainer.hooks import ORCHESTRATOR_STATE, StartInference, SubmitRollouts, SyncWeights
from verifiers_rl.rl.trainer.losses import policy_loss
from verifiers_rl.rl.trainer.microbatches import collate_packed, collate_padded, plan_microbatches
from verifiers_rl.rl.trainer.prompts import filter_prompts
from verifiers_rl.rl.trainer.runtime import InferenceRuntime
from verifiers_rl.rl.trainer.samples import PreparedBatch, prepare_batch, shard_samples

_ADDITIVE = ("ratio_mean", "masked_frac", "mismatch_kl", "kl")


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


class RLTrainer(Trainer):
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
        model_path = model if isinstance(model, str) else getattr(model, "name_or_path", None)
        if isinstance(model, str):
            model = get_model(model, use_liger=args.use_liger)
        if processing_class is None:
            if not model_path:
                raise ValueError("pass processing_class (the tokenizer) when model has no name_or_path")
            processing_class = get_tokenizer(model_path)
        ensure_pad_token(processing_class, model)
        model = self._wrap_lora(model, args)
        self.env = env
        self.model_path = model_path
        self.train_rows, self.prompts_filtered = filter_prompts(
            env.get_dataset(), processing_class, args.prompt_limit, env
        )
        self.runtime = InferenceRuntime(args, model_path, env)
        self.resume_from: str | None = None
        self.step_metrics: dict[str, float] = {}
        self._empty_steps = 0
        self._seen_failures: set[str | None] = set()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        hooks = [StartInference(self), SyncWeights(self), SubmitRollouts(self)]
        callbacks = [*hooks, MetricsFileCallback(), *(callbacks or [])]
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
        self.remove_callback(ProgressCallback)
        self.add_callback(RichProgressCallback(self))

    @staticmethod
    def _wrap_lora(model, args: RLConfig):
        if not args.use_lora or hasattr(model, "peft_config"):
            return model
        from peft import get_peft_model
        from transformers import set_seed

        from verifiers_rl.rl.trainer.lora import lora_config

        set_seed(args.seed)  # LoRA A is random-initialised: seed it so runs (and ranks) start identically
        config = args.lora_config or lora_config(
            args.lora_rank,
            args.lora_alpha,
            args.lora_dropout,
            args.lora_target_modules,
            args.lora_modules_to_save,
            args.lora_use_rslora,
        )
        model = get_peft_model(model, config)
        if args.gradient_checkpointing:
            model.enable_input_require_grads()
        return model

    # ------------------------------------------------------------------ lifecycle

    def train(self, resume_from_checkpoint=None, **kwargs):
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"resume_from_checkpoint=True but no checkpoint in {self.args.output_dir}")
        self.resume_from = resume_from_checkpoint
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        finally:
            self.runtime.stop_rollouts()

    def close(self) -> None:
        """Stop rollouts and the inference server this trainer spawned."""
        self.runtime.close()

    def sync_weights(self) -> float:
        return self.runtime.sync(self.accelerator.unwrap_model(self.model), version=self.state.global_step)

    # ------------------------------------------------------------------ one step

    def training_step(self, model, inputs, num_items_in_batch=None):
        args: RLConfig = self.args
        t0 = time.perf_counter()
        payload = [None]
        if self.is_world_process_zero():
            batch = self.runtime.next_batch(self.state.global_step)
            prepared = prepare_batch(batch.rollouts, args, current_version=self.state.global_step)
            prepared.metrics["timing/generation_s"] = batch.generation_seconds
            prepared.metrics["timing/wait_s"] = time.perf_counter() - t0
            self._report_failures(batch.rollouts, prepared)
            payload = [prepared]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(payload, from_process=0)
        prepared: PreparedBatch = payload[0]
        self._stop_when_nothing_trains(prepared)
        t_train = time.perf_counter()
        model.train()
        loss, metrics = self._run_microbatches(model, prepared)
        metrics.update(prepared.metrics)
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

    def _microbatches(self, prepared: PreparedBatch) -> list[dict]:
        args: RLConfig = self.args
        mine = shard_samples(prepared.samples, self.accelerator.num_processes, self.accelerator.process_index)
        lengths = [len(s["input_ids"]) for s in mine]
        plan = plan_microbatches(
            lengths, args.token_budget, packed=args.pack_sequences, max_samples=args.micro_batch_size
        )
        out = []
        for idx in plan:
            group = [mine[i] for i in idx]
            if args.pack_sequences:
                out.append(collate_packed(group, self._packed_row_len(group), self.processing_class.pad_token_id))
            else:
                out.append(collate_padded(group, self.processing_class.pad_token_id))
        return out

    def _run_microbatches(self, model, prepared: PreparedBatch):
        args: RLConfig = self.args
        device = self.accelerator.device
        mbs = self._microbatches(prepared)
        # DDP all-reduces on every backward outside no_sync: every rank must run the same number of them.
        n = len(mbs)
        if self.accelerator.num_processes > 1:
            n = int(self.accelerator.gather(torch.tensor([n], device=device)).max())
        unwrapped = self.accelerator.unwrap_model(model)
        head = output_head(unwrapped)
        total = torch.zeros((), device=device)
        sums: dict[str, float] = defaultdict(float)
        extremes = {"ratio_min": float("inf"), "ratio_max": float("-inf")}
        real = padded = 0
        for i in range(n):
            mb = mbs[i] if i < len(mbs) else None
            ctx = self.accelerator.no_sync(model) if i < n - 1 else contextlib.nullcontext()
            with ctx:
                if mb is None:  # this rank has fewer micro-batches: a zero-weight pass keeps DDP in step
                    mb = self._empty_microbatch(prepared)
                batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in mb.items()}
                logprobs, entropy = token_logprobs(model, head, batch, args.temperature)
                sampler = torch.where(
                    torch.isnan(batch["sampler_logprobs"]), logprobs.detach(), batch["sampler_logprobs"]
                )
                ref = reference_logprobs(unwrapped, batch, args.temperature) if args.kl_beta > 0 else None
                loss, m = policy_loss(
                    logprobs,
                    sampler,
                    batch["advantages"],
                    batch["loss_mask"],
                    loss_type=args.loss_type,
                    num_tokens_global=max(prepared.num_tokens, 1),
                    num_sequences_global=max(prepared.num_sequences, 1),
                    max_tokens=args.max_tokens or args.max_seq_len,
                    mask_ratio_low=args.mask_ratio_low,
                    mask_ratio_high=args.mask_ratio_high,
                    clip_eps_low=args.epsilon,
                    clip_eps_high=args.epsilon_high,
                    ref_logprobs=ref,
                    kl_beta=args.kl_beta,
                    seq_index=batch.get("seq_index"),
                )
                if mb.get("empty"):
                    loss = loss * 0.0
                # DDP averages gradients over ranks; the loss is already normalised globally
                self.accelerator.backward(loss * self.accelerator.num_processes)
            total += loss.detach()
            if not mb.get("empty"):
                # policy_loss metrics are already weighted by 1/num_tokens_global: they add up to step means
                for k in _ADDITIVE:
                    if k in m:
                        sums[k] += float(m[k])
                mask = batch["loss_mask"]
                extremes["ratio_min"] = min(extremes["ratio_min"], float(m["ratio_min"]))
                extremes["ratio_max"] = max(extremes["ratio_max"], float(m["ratio_max"]))
                if entropy is not None:
                    sums["entropy_sum"] += float(entropy[mask].sum())
                sums["trained_tokens"] += float(mask.sum())
                real += int(mb.get("num_real_tokens", mask.numel()))
                padded += int(mb.get("num_padded_tokens", 0))
        keys = [*_ADDITIVE, "entropy_sum", "trained_tokens"]
        vec = torch.tensor([sums[k] for k in keys] + [real, padded], dtype=torch.float64, device=device)
        if self.accelerator.num_processes > 1:
            vec = self.accelerator.reduce(vec, reduction="sum")
        red = dict(zip([*keys, "real", "padded"], vec.tolist()))
        metrics = {k: red[k] for k in _ADDITIVE if k != "kl" or args.kl_beta > 0}
        metrics["entropy"] = red["entropy_sum"] / max(red["trained_tokens"], 1.0)
        metrics["trained_tokens"] = red["trained_tokens"]
        metrics.update({k: v for k, v in extremes.items() if abs(v) != float("inf")})
        real, padded = red["real"], red["padded"]
        metrics["tokens"] = float(sum(len(s["input_ids"]) for s in prepared.samples))
        metrics["padding_frac"] = padded / max(real + padded, 1)
        metrics["microbatches"] = float(len(mbs))
        return total, metrics

    def _packed_row_len(self, group: list[dict]) -> int | None:
        # flash-attention runs a packed row as varlen (cost ~ sum of len^2): one row is best. Any other attention
        # builds a dense [N, N] block-diagonal mask, so rows are as wide as the micro-batch's longest sample:
        # the cost of the padded layout, with short samples filling the gaps instead of padding.
        impl = str(getattr(self.accelerator.unwrap_model(self.model).config, "_attn_implementation", "") or "")
        return None if "flash" in impl else max(len(s["input_ids"]) for s in group)

    def _empty_microbatch(self, prepared: PreparedBatch) -> dict:
        sample = {"input_ids": [0, 0], "loss_mask": [False, True], "sampler_logprobs": [0.0, 0.0], "advantage": 0.0}
        mb = collate_packed([sample]) if self.args.pack_sequences else collate_padded([sample], 0)
        mb["empty"] = True
        return mb

    def floating_point_ops(self, inputs) -> int:
        return 0  # inputs are step markers; FLOPs are not tracked

    # ------------------------------------------------------------------ logging, checkpoints, eval

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.step_metrics:
            logs = {**logs, **self.step_metrics}
            self.step_metrics = {}
        super().log(logs, start_time)

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        if self.is_world_process_zero() and self.runtime.orchestrator is not None:
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            torch.save(self.runtime.orchestrator.state_dict(), os.path.join(folder, ORCHESTRATOR_STATE))

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Rollouts on the environment's eval split with the current policy. Only the main process talks to the
        server (the others would start or re-initialise one); every process gets the same metrics."""
        payload = [None]
        if self.is_world_process_zero():
            model = self.accelerator.unwrap_model(self.model)
            payload = [self.runtime.evaluate(model, self.processing_class, metric_key_prefix, self.state.global_step)]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(payload, from_process=0)
        metrics = payload[0]
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics
