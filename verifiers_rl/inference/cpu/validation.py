"""Request checks shared by the CPU engines: a bad request is a 400 for that request, never a crash of the
generation loop (an out-of-vocabulary id used to reach the embedding lookup inside the batch and take every
in-flight request down with it)."""

from __future__ import annotations

from verifiers_rl.config.limits import request_fits
from verifiers_rl.inference.cpu.sampling import SamplingParams


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
