"""The context rule every request meets, in one place: the server applies it to each request, the trainer's
preflight to each prompt, so a prompt the preflight keeps is one the server accepts.

vLLM's rule, which our CPU engine keeps: the prompt's tokens plus the tokens asked for (`max_tokens`, or at least
one when unset) must fit in `max_model_len`.
"""

from __future__ import annotations


def room_for_prompt(max_model_len: int, max_tokens: int | None) -> int:
    """The longest prompt (tokens, chat template and tool schemas included) a request may carry."""
    return max_model_len - (max_tokens or 1)


def request_fits(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> bool:
    return 0 < prompt_tokens <= room_for_prompt(max_model_len, max_tokens)
