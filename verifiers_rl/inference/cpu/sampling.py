"""Sampling: per-request parameters and the pure tensor functions that turn logits into tokens + logprobs.

The order follows vLLM's sampler so that both engines return the same numbers: penalties on the raw logits,
then temperature, min-p, top-k/top-p, and the logprob of the sampled token under that *processed*
distribution (vLLM's `--logprobs-mode processed_logprobs`). With top_p=1, top_k off, min_p=0 and no
penalties, that logprob is exactly log_softmax(logits / temperature), which is what the trainer recomputes.

transformers' continuous batching has per-request temperature/top-k/top-p but no per-request seed, min-p or
penalties, so the engine calls these functions from its own sampling hook.

Both CPU engines also check a request here before it joins a batch (`check_prompt`: a bad request is a 400 for that
request, never a crash of the generation loop; an out-of-vocabulary id used to reach the embedding lookup inside
the batch and take every in-flight request down with it), and end it at a stop string matched on the text the
client sees, special tokens skipped as the request asks, as vLLM does (`find_stop`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verifiers_rl.config.limits import request_fits

_GREEDY_EPS = 1e-5  # vLLM treats temperature below this as greedy


@dataclass
class Completion:
    """One finished choice of a request: what the engine sampled and under which policy version."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    stop_reason: str | int | None = None
    policy_version: int = 0


@dataclass
class SamplingParams:
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self):
        checks = [
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 0, "top_k", "must be -1 (off) or >= 0"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (1 <= self.n <= 128, "n", "must be in [1, 128]"),
            (0 <= self.top_logprobs <= 20, "top_logprobs", "must be in [0, 20]"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} {rule}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """vLLM semantics: repetition over prompt+output tokens (divide positive logits, multiply negative ones);
    presence and frequency over output tokens only. All penalty tensors are [N]."""
    n, vocab = logits.shape
    out_counts = torch.zeros(n, vocab, dtype=logits.dtype, device=logits.device)
    seen = torch.zeros(n, vocab, dtype=torch.bool, device=logits.device)
    for i, (p, o) in enumerate(zip(prompt_ids, output_ids)):
        if o:
            ids = torch.tensor(o, device=logits.device)
            out_counts[i].index_add_(0, ids, torch.ones(len(o), dtype=logits.dtype, device=logits.device))
        if p:
            seen[i, torch.tensor(p, device=logits.device)] = True
    seen |= out_counts > 0
    rep = repetition.unsqueeze(1).to(logits.dtype)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency.unsqueeze(1) * out_counts
    logits = logits - presence.unsqueeze(1) * (out_counts > 0).to(logits.dtype)
    return logits


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    # Greedy rows keep temperature 1 so their logprobs stay finite and meaningful.
    t = torch.where(temperature < _GREEDY_EPS, torch.ones_like(temperature), temperature)
    return logits / t.unsqueeze(1).to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """top_k: [N] ints (<= 0 or >= vocab means off); top_p: [N] in (0, 1]. Ties at the k-th value are kept."""
    vocab = logits.shape[-1]
    sorted_logits, _ = logits.sort(dim=-1, descending=True)
    k = torch.where((top_k <= 0) | (top_k >= vocab), torch.full_like(top_k, vocab), top_k)
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1).long())
    mask = logits < kth
    if bool((top_p < 1.0).any()):
        sorted_probs = torch.softmax(sorted_logits.masked_fill(sorted_logits < kth, float("-inf")), dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep_sorted = mass_before < top_p.unsqueeze(1)
        # Lowest kept logit per row; everything strictly below it goes.
        last_kept = keep_sorted.sum(dim=-1, keepdim=True).clamp(min=1) - 1
        cutoff = sorted_logits.gather(1, last_kept)
        mask |= logits < cutoff
    return logits.masked_fill(mask, float("-inf"))


def process_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompt_ids: list[list[int]] | None = None,
    output_ids: list[list[int]] | None = None,
) -> torch.Tensor:
    """[N, V] raw logits (float32) -> processed logits, one SamplingParams per row."""
    dev = logits.device
    if any(p.has_penalties for p in params):
        logits = apply_penalties(
            logits,
            prompt_ids or [[] for _ in params],
            output_ids or [[] for _ in params],
            torch.tensor([p.repetition_penalty for p in params], device=dev),
            torch.tensor([p.presence_penalty for p in params], device=dev),
            torch.tensor([p.frequency_penalty for p in params], device=dev),
        )
    if any(p.temperature != 1.0 for p in params):
        logits = apply_temperature(logits, torch.tensor([p.temperature for p in params], device=dev))
    if any(p.min_p > 0 for p in params):
        logits = apply_min_p(logits, torch.tensor([p.min_p for p in params], device=dev))
    if any(p.top_p < 1.0 or p.top_k > 0 for p in params):
        logits = apply_top_k_top_p(
            logits,
            torch.tensor([p.top_k for p in params], device=dev),
            torch.tensor([p.top_p for p in params], device=dev),
        )
    return logits


def sample(
    processed: torch.Tensor,
    greedy: list[bool],
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens [N], logprob of each token under `processed` [N]).

    Sampling is an exponential race (argmax of p / Exp(1)), which equals multinomial sampling and lets each
    seeded request draw its noise from its own generator: the result then depends only on the request's
    seed and its own history, not on which other requests share the batch.
    """
    logprobs = torch.log_softmax(processed, dim=-1)
    probs = logprobs.exp()
    noise = torch.empty_like(probs)
    for i, g in enumerate(generators):
        noise[i].exponential_(generator=g)
    tokens = (probs / noise).argmax(dim=-1)
    if any(greedy):
        g = torch.tensor(greedy, device=processed.device)
        tokens = torch.where(g, processed.argmax(dim=-1), tokens)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


def request_generator(seed: int | None, index: int = 0) -> torch.Generator | None:
    """A CPU generator for a seeded request; choice `index` of an n>1 request gets its own stream."""
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + index) % (2**63))
    return g


def sample_inverse_cdf(
    processed: torch.Tensor, greedy: list[bool], uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` by inverse CDF: one U(0, 1) draw per row ([N]) instead of V exponential draws.

    Same distribution as the exponential race (this is how torch.multinomial samples), and as independent of
    batch neighbours when each seeded request draws its uniforms from its own generator; drawing V numbers per
    row per step cost more than the whole forward pass of a small model (a 152k vocabulary: ~4.5 ms per row).
    """
    logprobs = torch.log_softmax(processed, dim=-1)
    cdf = logprobs.exp().cumsum(dim=-1)
    # scaled by the row's total so rounding in the cumsum can never push u past the last token
    u = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(1)
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=processed.shape[-1] - 1)
    if any(greedy):
        g = torch.tensor(greedy, device=processed.device)
        tokens = torch.where(g, processed.argmax(dim=-1), tokens)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


class UniformStream:
    """A sequence's U(0, 1) draws for inverse-CDF sampling, 256 per generator call. They depend only on the
    generator's seed, so a seeded sequence samples the same tokens whatever shares its batch."""

    CHUNK = 256

    def __init__(self, generator: torch.Generator | None):
        self.generator = generator
        self.buf: list[float] = []

    def next(self) -> float:
        if not self.buf:
            self.buf = torch.rand(self.CHUNK, generator=self.generator, dtype=torch.float64).tolist()[::-1]
        return self.buf.pop()


def check_prompt(prompt_ids: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int) -> int:
    """Validate a prompt against the model; return the request's max new tokens. Raises ValueError with vLLM's
    wording (the server turns it into HTTP 400)."""
    if not prompt_ids:
        raise ValueError("prompt is empty")
    lo, hi = min(prompt_ids), max(prompt_ids)
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"Token id {lo if lo < 0 else hi} is out of vocabulary (vocab size {vocab_size})")
    if not request_fits(len(prompt_ids), params.max_tokens, max_model_len):
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(prompt_ids) + (params.max_tokens or 1)} tokens ({len(prompt_ids)} in the messages, "
            f"{params.max_tokens or 1} in the completion). Please reduce the length of the messages or completion."
        )
    return params.max_tokens or max_model_len - len(prompt_ids)


def stop_tail(stops: list[str]) -> int:
    """Tokens of the tail that can hold a new match: the longest stop string's bytes, plus slack for tokens that
    decode to nothing or straddle a character."""
    return max((len(s.encode()) for s in stops), default=0) + 8


def find_stop(tokenizer, stops: list[str], skip_special: bool, tokens: list[int], tail: int) -> tuple[int, str] | None:
    """The shortest token prefix whose text contains a stop string, and that string; None while none does.
    Only the last `tail` tokens are decoded per call, so checking after every token stays O(1)."""
    text = tokenizer.decode(tokens[-tail:], skip_special_tokens=skip_special)
    if not any(s in text for s in stops):
        return None
    for n in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:n], skip_special_tokens=skip_special)
        for s in stops:
            if s in text:
                return n, s
    return None
