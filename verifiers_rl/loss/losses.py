"""Policy-gradient losses of the GRPO family, summed per micro-batch with globally normalised token weights.

Notation per trained token t (loss_mask True) of sequence b: l_t = trainer log-prob, q_t = sampler log-prob,
r_t = exp(l_t - q_t), A_b the sequence's advantage, clip(x) = clamp(x, 1 - eps_low, 1 + eps_high), and
PPO(x, A) = -min(x A, clip(x) A). Each loss is  sum_t w_t * loss_t  over this micro-batch:

    "is"      loss_t = -r_t A_b, tokens with sg(r_t) outside [mask_ratio_low, mask_ratio_high] dropped;  w_t = 1/N_tok
    "grpo"    loss_t = PPO(r_t, A_b);                                         w_t = 1/(len_b * N_seq)
    "dapo"    loss_t = PPO(r_t, A_b)  (asymmetric eps, e.g. eps_high=0.28);   w_t = 1/N_tok
    "dr_grpo" loss_t = PPO(r_t, A_b);                                         w_t = 1/(N_seq * max_tokens)
    "gspo"    loss_b = PPO(s_b, A_b), s_b = exp(mean_{t in b}(l_t - q_t));    weight 1/N_seq per sequence
    "cispo"   loss_t = -sg(min(r_t, 1 + eps_high)) A_b l_t  (gradient only through l_t);  w_t = 1/N_tok

N_tok / N_seq are the trained tokens / sequences of the whole optimisation step (all micro-batches, all ranks)
and len_b the trained tokens of sequence b, so summing the micro-batch losses (no further averaging) yields the
step's loss. A sequence must not be split across micro-batches. With ref_logprobs and kl_beta > 0 the k3
estimate  kl_t = exp(ref_t - l_t) - (ref_t - l_t) - 1  adds  kl_beta * sum_t w_t kl_t  (gspo: w_t = 1/N_tok),
over all trained tokens, including those the "is" ratio bounds drop.

Layouts: padded [B, T] tensors (each row one sequence), or packed [1, N] tensors plus `seq_index` [1, N]
giving each position's sequence id (ids unique within the micro-batch); the per-sequence reductions of
grpo/gspo use seq_index when given. `advantages` is [B] (one per row) or per-token [B, T].

Metrics are detached scalars; METRIC_REDUCTIONS says how to combine them across micro-batches and ranks:
"sum" metrics are already token means weighted by 1/N_tok, so their sum over the step is the step's mean.
"""

from __future__ import annotations

import torch

from verifiers_rl.config.checks import LOSS_TYPES  # one list for the config and the loss

METRIC_REDUCTIONS = {
    "ratio_mean": "sum",  # mean of r_t over the step's trained tokens
    "ratio_min": "min",  # +inf for a micro-batch without trained tokens
    "ratio_max": "max",  # -inf for a micro-batch without trained tokens
    "masked_frac": "sum",  # "is": tokens dropped by the ratio bounds; clip losses: tokens whose gradient the
    # clip zeroes (gspo: tokens of such sequences); cispo: tokens whose IS weight was capped
    "mismatch_kl": "sum",  # k3 estimate of KL(sampler || trainer): mean of r - log r - 1
    "kl": "sum",  # k3 estimate of KL(trainer || ref), only when ref_logprobs is given
}


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(x) - x - 1 >= 0: Schulman's unbiased, low-variance KL estimator for x = log(p/q), samples from q."""
    return torch.expm1(log_ratio) - log_ratio


def ppo_clip(
    ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO(x, A) = -min(x A, clip(x, 1-eps_low, 1+eps_high) A), and where the clipped branch kills the gradient."""
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    r = ratio.detach()
    zero_grad = ((adv > 0) & (r > 1.0 + eps_high)) | ((adv < 0) & (r < 1.0 - eps_low))
    return -torch.minimum(unclipped, clipped), zero_grad


def _positive(count: int | float | torch.Tensor) -> int | float | torch.Tensor:
    # A step with no trained tokens has all-zero numerators; dividing by 1 keeps the loss a finite 0.
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)


def sequence_ids(loss_mask: torch.Tensor, seq_index: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """[B, T] sequence id per position (0 where untrained, so it is always a valid index) and the id count."""
    if seq_index is None:
        b, t = loss_mask.shape
        return torch.arange(b, device=loss_mask.device).unsqueeze(1).expand(b, t), b
    if seq_index.shape != loss_mask.shape:
        raise ValueError(
            f"seq_index must have loss_mask's shape {tuple(loss_mask.shape)}, got {tuple(seq_index.shape)}"
        )
    seq = torch.where(loss_mask, seq_index.long(), torch.zeros_like(seq_index, dtype=torch.long))
    return seq, int(seq.max()) + 1 if seq.numel() else 0


def per_sequence_sum(x: torch.Tensor, seq: torch.Tensor, num: int) -> torch.Tensor:
    """[S] sums of x over each sequence id (differentiable)."""
    return x.new_zeros(num).index_add(0, seq.reshape(-1), x.reshape(-1))


def _token_weight(loss_type, maskf, seq, num_seqs, num_tokens_global, num_sequences_global, max_tokens):
    if loss_type in ("is", "dapo", "cispo", "gspo"):
        return maskf / _positive(num_tokens_global)
    if loss_type == "grpo":
        length = per_sequence_sum(maskf, seq, num_seqs).clamp(min=1)
        return maskf / (length[seq] * _positive(num_sequences_global))
    return maskf / (_positive(num_sequences_global) * max_tokens)  # dr_grpo


def policy_loss(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    loss_type: str,
    num_tokens_global: int | float | torch.Tensor,
    num_sequences_global: int | float | torch.Tensor,
    max_tokens: int | None = None,
    mask_ratio_low: float = 0.125,
    mask_ratio_high: float = 8.0,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    seq_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the step loss (see module docstring) and its additive metrics."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if loss_type == "dr_grpo" and max_tokens is None:
        raise ValueError("loss_type 'dr_grpo' needs max_tokens (the completion token limit)")
    if kl_beta > 0 and ref_logprobs is None:
        raise ValueError("kl_beta > 0 needs ref_logprobs")
    if sampler_logprobs.shape != logprobs.shape or loss_mask.shape != logprobs.shape or logprobs.dim() != 2:
        raise ValueError(
            "logprobs, sampler_logprobs and loss_mask must share one [B, T] shape, got "
            f"{tuple(logprobs.shape)}, {tuple(sampler_logprobs.shape)}, {tuple(loss_mask.shape)}"
        )
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages must be [B] or [B, T] for logprobs {tuple(logprobs.shape)}, got {tuple(advantages.shape)}"
        )

    mask = loss_mask.bool()
    maskf = mask.float()
    logp = torch.where(mask, logprobs.float(), 0.0)  # padding may hold garbage; exp(garbage) * 0 can be NaN
    adv = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages).float().expand_as(logp)
    log_ratio = logp - torch.where(mask, sampler_logprobs.float(), 0.0)
    ratio = torch.exp(log_ratio)
    seq, num_seqs = sequence_ids(mask, seq_index)
    weight = _token_weight(loss_type, maskf, seq, num_seqs, num_tokens_global, num_sequences_global, max_tokens)
    r = ratio.detach()

    if loss_type == "is":
        keep = mask & (r >= mask_ratio_low) & (r <= mask_ratio_high)
        loss = (-ratio * adv * weight * keep).sum()
        masked = mask & ~keep
    elif loss_type == "cispo":
        loss = (-ratio.clamp(max=1.0 + clip_eps_high).detach() * adv * logp * weight).sum()
        masked = mask & (r > 1.0 + clip_eps_high)
    elif loss_type == "gspo":
        length = per_sequence_sum(maskf, seq, num_seqs)
        denom = length.clamp(min=1)
        seq_ratio = torch.exp(per_sequence_sum(log_ratio * maskf, seq, num_seqs) / denom)
        seq_adv = per_sequence_sum(adv * maskf, seq, num_seqs) / denom
        seq_loss, seq_zero_grad = ppo_clip(seq_ratio, seq_adv, clip_eps_low, clip_eps_high)
        loss = (seq_loss * (length > 0)).sum() / _positive(num_sequences_global)
        masked = mask & seq_zero_grad[seq]
    else:
        tok_loss, zero_grad = ppo_clip(ratio, adv, clip_eps_low, clip_eps_high)
        loss = (tok_loss * weight).sum()
        masked = mask & zero_grad

    per_token = maskf / _positive(num_tokens_global)
    metrics = {
        "ratio_mean": (r * per_token).sum(),
        "ratio_min": torch.where(mask, r, torch.inf).amin() if r.numel() else r.new_tensor(torch.inf),
        "ratio_max": torch.where(mask, r, -torch.inf).amax() if r.numel() else r.new_tensor(-torch.inf),
        "masked_frac": (masked.float() * per_token).sum(),
        "mismatch_kl": (k3(log_ratio.detach()) * per_token).sum(),
    }
    if ref_logprobs is not None:
        kl = k3(torch.where(mask, ref_logprobs.float(), 0.0) - logp)
        if kl_beta > 0:
            kl_weight = per_token if loss_type == "gspo" else weight
            loss = loss + kl_beta * (kl * kl_weight).sum()
        metrics["kl"] = (kl.detach() * per_token).sum()
    return loss, {k: v.detach() for k, v in metrics.items()}
