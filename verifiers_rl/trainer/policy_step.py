"""One optimizer step's forward/backward passes: this rank's samples, micro-batched, through the policy loss.

Every rank runs the same number of backwards (DDP all-reduces on each one outside no_sync); the loss of each
micro-batch is already normalised over the whole step (all micro-batches, all ranks).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict

import torch

from verifiers_rl.batch.microbatches import MicroBatch, collate_packed, collate_padded, plan_microbatches
from verifiers_rl.batch.prefix_sharing import (
    Unit,
    additive_mask,
    collate_shared,
    layer_costs,
    plan_cost,
    plan_units,
    unit_length,
)
from verifiers_rl.batch.samples import PreparedBatch, Sample, shard_samples
from verifiers_rl.loss.forward import reference_logprobs, token_logprobs
from verifiers_rl.loss.losses import policy_loss
from verifiers_rl.sync.export import weight_export

_ADDITIVE = ("ratio_mean", "masked_frac", "mismatch_kl", "kl")


def microbatches(accelerator, model, prepared: PreparedBatch, args, pad_token_id: int) -> list[MicroBatch]:
    """This rank's share of the step's samples, planned into token-budget micro-batches and collated: with
    each group's prompt shared (prefix_sharing.py) where the attention allows it and that costs fewer FLOPs."""
    mine = shard_samples(prepared.samples, accelerator.num_processes, accelerator.process_index)
    unwrapped = accelerator.unwrap_model(model)
    lengths = [len(s.input_ids) for s in mine]
    plan = plan_microbatches(lengths, args.token_budget, packed=args.pack_sequences, max_samples=args.micro_batch_size)
    shared = _shared_plan(mine, plan, args, unwrapped)
    if shared is not None:
        return [_collate_shared(mine, units, unwrapped, pad_token_id) for units in shared]
    out = []
    for idx in plan:
        group = [mine[i] for i in idx]
        if args.pack_sequences:
            out.append(collate_packed(group, packed_row_len(unwrapped, group), pad_token_id))
        else:
            out.append(collate_padded(group, pad_token_id))
    return out


def _shared_plan(samples: list[Sample], plain: list[list[int]], args, model) -> list[list[Unit]] | None:
    """Micro-batches of shared-prompt units, or None where the plain packed plan is the better (or the only)
    layout. Costs are estimated FLOPs of both layouts as the collators would lay them out."""
    dense_mask = attn_implementation(model) in ("sdpa", "eager")
    if not (args.pack_sequences and args.share_prompt_prefix and dense_mask) or not samples:
        return None
    units = plan_units(samples, args.micro_batch_size, args.token_budget)
    if all(p == 0 for _, p in units):
        return None
    lengths = [len(s.input_ids) for s in samples]
    unit_lengths = [unit_length([lengths[i] for i in idx], p) for idx, p in units]
    sizes = [len(idx) for idx, _ in units]
    budget, cap = args.token_budget, args.micro_batch_size
    plan = plan_microbatches(unit_lengths, budget, packed=True, max_samples=cap, sizes=sizes)
    per_token, per_pair = layer_costs(model.config)
    if plan_cost(plan, unit_lengths, per_token, per_pair) >= plan_cost(plain, lengths, per_token, per_pair):
        return None
    return [[units[u] for u in mb] for mb in plan]


def _collate_shared(samples: list[Sample], units: list[Unit], model, pad_token_id: int) -> MicroBatch:
    # collate_shared takes sample indices of one micro-batch: renumber the units' indices into it
    idx = [i for u, _ in units for i in u]
    pos = {i: k for k, i in enumerate(idx)}
    local = [([pos[i] for i in u], p) for u, p in units]
    lens = [unit_length([len(samples[i].input_ids) for i in u], p) for u, p in units]
    mb = collate_shared([samples[i] for i in idx], local, max(lens), pad_token_id)
    if attn_implementation(model) == "eager":
        mb.attention_mask = additive_mask(mb.attention_mask, model.dtype)
    return mb


def run_microbatches(accelerator, model, prepared: PreparedBatch, args, pad_token_id: int):
    """Forward/backward of every micro-batch of the step (gradients accumulate; the caller steps the optimizer);
    returns (loss summed over micro-batches, step metrics reduced over ranks)."""
    device = accelerator.device
    mbs = microbatches(accelerator, model, prepared, args, pad_token_id)
    # DDP all-reduces on every backward outside no_sync: every rank must run the same number of them.
    n = len(mbs)
    if accelerator.num_processes > 1:
        n = int(accelerator.gather(torch.tensor([n], device=device)).max())
    unwrapped = accelerator.unwrap_model(model)
    export = weight_export(model, accelerator)
    total = torch.zeros((), device=device)
    sums: dict[str, float] = defaultdict(float)
    extremes = {"ratio_min": float("inf"), "ratio_max": float("-inf")}
    real = padded = shared = 0
    for i in range(n):
        mb = mbs[i] if i < len(mbs) else None
        if mb is None:  # this rank has fewer micro-batches: a zero-weight pass keeps DDP in step
            mb = empty_microbatch(args.pack_sequences)
        ctx = contextlib.ExitStack()
        if i < n - 1:
            ctx.enter_context(accelerator.no_sync(model))
        with ctx:
            batch = mb.to(device)
            logprobs, entropy = token_logprobs(model, export, batch, args.temperature)
            sampler = torch.where(torch.isnan(batch.sampler_logprobs), logprobs.detach(), batch.sampler_logprobs)
            ref = reference_logprobs(unwrapped, export, batch, args.temperature) if args.kl_beta > 0 else None
            loss, m = policy_loss(
                logprobs,
                sampler,
                batch.advantages,
                batch.loss_mask,
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
                seq_index=batch.sample_of_target(),
            )
            if mb.empty:
                loss = loss * 0.0
            # DDP averages gradients over ranks; the loss is already normalised globally
            backward(accelerator, loss * accelerator.num_processes, last=i == n - 1)
        total += loss.detach()
        if not mb.empty:
            # policy_loss metrics are already weighted by 1/num_tokens_global: they add up to step means
            for k in _ADDITIVE:
                if k in m:
                    sums[k] += float(m[k])
            mask = batch.loss_mask
            extremes["ratio_min"] = min(extremes["ratio_min"], float(m["ratio_min"]))
            extremes["ratio_max"] = max(extremes["ratio_max"], float(m["ratio_max"]))
            if entropy is not None:
                sums["entropy_sum"] += float(entropy[mask].sum())
            sums["trained_tokens"] += float(mask.sum())
            real += mb.num_real_tokens
            padded += mb.num_padded_tokens
            shared += mb.num_shared_tokens
    keys = [*_ADDITIVE, "entropy_sum", "trained_tokens"]
    vec = torch.tensor([sums[k] for k in keys] + [real, padded, shared], dtype=torch.float64, device=device)
    if accelerator.num_processes > 1:
        vec = accelerator.reduce(vec, reduction="sum")
    red = dict(zip([*keys, "real", "padded", "shared"], vec.tolist()))
    metrics = {k: red[k] for k in _ADDITIVE if k != "kl" or args.kl_beta > 0}
    metrics["entropy"] = red["entropy_sum"] / max(red["trained_tokens"], 1.0)
    metrics["trained_tokens"] = red["trained_tokens"]
    metrics.update({k: v for k, v in extremes.items() if abs(v) != float("inf")})
    real, padded = red["real"], red["padded"]
    metrics["tokens"] = float(sum(len(s.input_ids) for s in prepared.samples))
    metrics["padding_frac"] = padded / max(real + padded, 1)
    metrics["shared_prefix_frac"] = red["shared"] / max(metrics["tokens"], 1.0)  # prompt tokens not recomputed
    metrics["microbatches"] = float(len(mbs))
    return total, metrics


def packed_row_len(model, group: list[Sample]) -> int | None:
    # flash-attention runs a packed row as varlen (cost ~ sum of len^2): one row is best. Any other attention
    # builds a dense [N, N] block-diagonal mask, so rows are as wide as the micro-batch's longest sample:
    # the cost of the padded layout, with short samples filling the gaps instead of padding.
    return None if "flash" in attn_implementation(model) else max(len(s.input_ids) for s in group)


def attn_implementation(model) -> str:
    return str(getattr(model.config, "_attn_implementation", "") or "")


def empty_microbatch(packed: bool) -> MicroBatch:
    """A zero-weight micro-batch for a rank that has fewer than the others (DDP needs the same backwards)."""
    sample = Sample([0, 0], [False, True], [0.0, 0.0], advantage=0.0, rollout=-1)  # one trained target, no rollout
    mb = collate_packed([sample]) if packed else collate_padded([sample], 0)
    return dataclasses.replace(mb, empty=True)


def backward(accelerator, loss: torch.Tensor, last: bool) -> None:
    """One micro-batch's backward. DeepSpeed steps its optimizer inside backward whenever it is at an accumulation
    boundary, and `accelerator.backward` says every backward is one: only the step's last micro-batch may be, or a
    step of several micro-batches would take as many optimizer steps (and the later micro-batches' logprobs would
    come from already-updated weights)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        accelerator.deepspeed_engine_wrapped.backward(loss, sync_gradients=last)
    else:
        accelerator.backward(loss)
