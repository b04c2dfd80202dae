"""One micro-batch through the policy: per-token logprobs of the sampled tokens, at trained positions only.

With a head every rank holds whole, the model runs with `logits_to_keep=1`, so it never builds [B, T, V] logits;
the final hidden states go through the output head in checkpointed chunks (`logprobs.chunked_logprobs`), and
only at positions whose token is trained. A sharded head (ZeRO-3, FSDP2) is used inside the model's forward,
whose hooks gather it: the model returns logits at the columns that hold a trained target (`logits_to_keep` as
positions), [B, P, V] instead of [B, T, V]. Temperature is applied exactly as the inference engine applies it.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from verifiers_rl.batch.microbatches import MicroBatch
from verifiers_rl.loss.logprobs import chunked_logprobs, logits_logprobs, output_head


class HeadPlacement(Protocol):
    """Where the model's output head runs (sync's `WeightExport` says it): a sharded head is only reached inside
    the model's own forward, a whole one is applied here in vocabulary chunks, from the unwrapped model (no DDP
    wrapper in front of `get_output_embeddings`)."""

    head_in_forward: bool
    model: torch.nn.Module  # unwrapped


def model_inputs(mb: MicroBatch, logits_to_keep: int | torch.Tensor = 1) -> dict:
    """The model's keyword arguments for one micro-batch (no KV cache: packed rows need attention_mask=None).
    `logits_to_keep=1`: hidden states out, the head applied by the caller; positions: logits at those columns."""
    hidden = isinstance(logits_to_keep, int)
    return {**mb.model_inputs(), "use_cache": False, "output_hidden_states": hidden, "logits_to_keep": logits_to_keep}


def token_logprobs(
    model,
    export: HeadPlacement,
    mb: MicroBatch,
    temperature: float,
    *,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T-1] logprobs of `target_ids` (0 where not trained) and the matching entropies (no grad)."""
    mask = mb.loss_mask
    targets = mb.target_ids[mask]
    if export.head_in_forward:
        # column j of the logits predicts token j+1, as row j of mask/targets describes it
        columns = mask.any(dim=0).nonzero().squeeze(-1)
        logits = model(**model_inputs(mb, logits_to_keep=columns)).logits
        lp, ent = logits_logprobs(logits[mask[:, columns]], targets, temperature, with_entropy=with_entropy)
    else:
        hidden = model(**model_inputs(mb)).hidden_states[-1][:, :-1]  # position t predicts token t+1
        head = output_head(export.model)
        lp, ent = chunked_logprobs(
            hidden[mask],
            head.weight,
            targets,
            bias=getattr(head, "bias", None),
            temperature=temperature,
            with_entropy=with_entropy,
        )
    logprobs = torch.zeros(mask.shape, dtype=torch.float32, device=lp.device).masked_scatter(mask, lp)
    entropy = None
    if ent is not None:
        entropy = torch.zeros(mask.shape, dtype=torch.float32, device=ent.device).masked_scatter(mask, ent)
    return logprobs, entropy


def reference_logprobs(model, export: HeadPlacement, mb: MicroBatch, temperature: float) -> torch.Tensor:
    """Logprobs under the reference policy: the same model with its LoRA adapter disabled."""
    disable = getattr(model, "disable_adapter", None)
    ctx = disable() if callable(disable) else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        lp, _ = token_logprobs(model, export, mb, temperature, with_entropy=False)
    return lp
