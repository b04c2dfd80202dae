"""The SFT warm-start's loss without [tokens, vocab] logits.

TRL's SFTTrainer lets the model build its logits for the whole batch (float32 in the loss: at a 151,936-row
vocabulary, 8 x 256 tokens are 1.2 GiB, 16 x 512 are 5 GiB) and autograd keeps them, and their softmax, until
backward. `ChunkedSFTTrainer` asks the model for hidden states only (`logits_to_keep=1`) and takes the
cross-entropy of the trained positions through the LM head chunk by chunk (`chunked_logprobs`' Function, whose
backward recomputes each chunk's logits): the same loss, normalised as TRL normalises it (`num_items_in_batch`),
with one chunk's logits alive at a time. TRL's logit metrics are kept, computed per chunk: `mean_token_accuracy`
as TRL defines it (trained positions), `entropy` over the trained positions (TRL averages it over every attended
position, prompts included; the prompt positions' logits are what this path never builds).

Setups this does not cover go to TRL's own `compute_loss`: liger, `loss_type != "nll"`, a `compute_loss_func`,
pre-shifted labels (context parallelism), prompt tuning, a LoRA adapter on the head, a sharded head (FSDP,
DeepSpeed), evaluation.
"""

from __future__ import annotations

import torch
from trl import SFTTrainer

from verifiers_rl.loss.logprobs import (
    _ChunkedLogprobs,
    _entropy,
    _in_head_dtype,
    _scaled_logits,
    auto_chunk_size,
    output_head,
)


class _LogprobsAndHits(_ChunkedLogprobs):
    """`_ChunkedLogprobs` whose forward also says, per row, whether the target is the argmax (TRL's token
    accuracy); its backward is the parent's, so the head's gradient still goes into one buffer."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, with_entropy):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device)
        hits = torch.empty(n, dtype=torch.bool, device=hidden.device)
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            z = _scaled_logits(hidden[start:stop], weight, bias, temperature)
            lse = torch.logsumexp(z, dim=-1)
            logp[start:stop] = z.gather(-1, targets[start:stop, None]).squeeze(-1) - lse
            entropy[start:stop] = _entropy(z, lse)
            hits[start:stop] = z.argmax(dim=-1) == targets[start:stop]
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(entropy, hits)
        return logp, entropy, hits

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy, _grad_hits):
        return _ChunkedLogprobs.backward(ctx, grad_logp, None)


def chunked_completion_loss(model, inputs: dict, num_items_in_batch=None, chunk_size: int | None = None, head=None):
    """(loss, stats) of a causal LM on `inputs` (with `labels`, -100 where not trained), as transformers'
    ForCausalLMLoss computes it: summed cross-entropy over `num_items_in_batch`, or its mean when None.
    `stats`: summed entropy and argmax hits over the trained positions, and their count (no grad). `head`: the
    output layer when `model` is a wrapper (DataParallel) that does not expose it."""
    inputs = dict(inputs)
    labels = inputs.pop("labels")
    inputs.update(use_cache=False, output_hidden_states=True, logits_to_keep=1)
    hidden = model(**inputs).hidden_states[-1][:, :-1]  # position t predicts token t+1
    shifted = labels[:, 1:]
    mask = shifted != -100
    head = output_head(model) if head is None else head
    chunk = chunk_size or auto_chunk_size(head.weight.shape[0])
    rows = _in_head_dtype(hidden[mask], head.weight)
    bias = getattr(head, "bias", None)
    logp, entropy, hits = _LogprobsAndHits.apply(rows, head.weight, bias, shifted[mask], 1.0, chunk, True)
    count = logp.numel()
    if num_items_in_batch is None:
        loss = -logp.sum() / max(count, 1)
    else:
        loss = -logp.sum() / torch.as_tensor(num_items_in_batch, device=logp.device)
    return loss, {"entropy": entropy.sum(), "hits": hits.sum(), "count": torch.tensor(count, device=logp.device)}


class ChunkedSFTTrainer(SFTTrainer):
    """SFTTrainer whose training loss never holds the batch's logits (see the module's docstring)."""

    def _chunked(self, model, inputs: dict) -> bool:
        args = self.args
        if not model.training or args.use_liger_kernel or args.loss_type != "nll" or self.compute_loss_func:
            return False
        if "shift_labels" in inputs or "labels" not in inputs or self.num_virtual_tokens > 0:
            return False
        if self.aux_loss_enabled:  # the model's own loss adds the router's auxiliary loss
            return False
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            return False  # a sharded head is gathered inside the model's forward only
        head = output_head(self.accelerator.unwrap_model(model))
        return not hasattr(head, "base_layer") and getattr(head, "weight", None) is not None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs or not self._chunked(model, inputs):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs.pop("_prediction_loss_only", None)
        if not self.model_accepts_loss_kwargs:
            num_items_in_batch = None  # the model's own loss is then a per-batch mean; Trainer divides it by GA
        head = output_head(self.accelerator.unwrap_model(model))
        loss, stats = chunked_completion_loss(model, inputs, num_items_in_batch, head=head)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # as Trainer.compute_loss scales the model's loss (num_items_in_batch counts every rank's tokens)
            loss = loss * (
                self.accelerator.num_processes // self.get_tp_size() if self.args.n_gpu <= 1 else self.args.n_gpu
            )
        self._log_metrics(inputs, stats)
        return loss

    def _log_metrics(self, inputs: dict, stats: dict) -> None:
        gather = self.accelerator.gather_for_metrics
        metrics = self._metrics["train"]
        count = gather(stats["count"]).sum()
        if count > 0:
            metrics["entropy"].append((gather(stats["entropy"]).sum() / count).item())
        metrics["mean_token_accuracy"].append((gather(stats["hits"]).sum() / count).item() if count > 0 else 0.0)
        if "attention_mask" in inputs:
            tokens = inputs["attention_mask"].sum()
        else:
            tokens = torch.tensor(inputs["position_ids"].size(1), device=inputs["position_ids"].device)
        self._total_train_tokens += gather(tokens).sum().item()
        metrics["num_tokens"] = [self._total_train_tokens]
