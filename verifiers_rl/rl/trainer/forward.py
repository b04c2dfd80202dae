"""One micro-batch through the policy: per-token logprobs of the sampled tokens, at trained positions only.

The model runs with `logits_to_keep=1`, so it never builds [B, T, V] logits; the final hidden states go
through the output head in checkpointed chunks (`logprobs.chunked_logprobs`, reached through the weight export,
which knows how the head is laid out across ranks), and only at positions whose token is trained. Temperature
is applied exactly as the inference engine applies it.
"""

from __future__ import annotations

import contextlib

import torch

from verifiers_rl.rl.trainer.microbatches import MicroBatch
from verifiers_rl.rl.trainer.weight_export import WeightExport


def model_inputs(mb: MicroBatch) -> dict:
    """The model's keyword arguments for one micro-batch (no KV cache: packed rows need attention_mask=None)."""
    inputs = {"input_ids": mb.input_ids, "use_cache": False, "output_hidden_states": True, "logits_to_keep": 1}
    if mb.position_ids is not None:  # packed: block-diagonal attention derived from position_ids
        inputs["position_ids"] = mb.position_ids
    if mb.attention_mask is not None:
        inputs["attention_mask"] = mb.attention_mask
    return inputs


def token_logprobs(
    model,
    export: WeightExport,
    mb: MicroBatch,
    temperature: float,
    *,
    with_entropy: bool = True,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, T-1] logprobs of `target_ids` (0 where not trained) and the matching entropies (no grad)."""
    out = model(**model_inputs(mb))
    hidden = out.hidden_states[-1][:, :-1]  # position t predicts token t+1
    mask = mb.loss_mask
    targets = mb.target_ids[mask]
    sel = hidden[mask]
    lp, ent = export.head_logprobs(
        sel, targets, temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy
    )
    logprobs = torch.zeros(mask.shape, dtype=torch.float32, device=lp.device).masked_scatter(mask, lp)
    entropy = None
    if ent is not None:
        entropy = torch.zeros(mask.shape, dtype=torch.float32, device=ent.device).masked_scatter(mask, ent)
    return logprobs, entropy


def reference_logprobs(model, export: WeightExport, mb: MicroBatch, temperature: float) -> torch.Tensor:
    """Logprobs under the reference policy: the same model with its LoRA adapter disabled."""
    disable = getattr(model, "disable_adapter", None)
    ctx = disable() if callable(disable) else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        lp, _ = token_logprobs(model, export, mb, temperature, with_entropy=False)
    return lp
