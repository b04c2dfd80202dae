"""Which tokens of a later turn's prompt the environment wrote, found from the messages (pure functions).

A turn's prompt is the server's rendering of the whole conversation so far. When the chat template renders history
exactly as it was sampled, turn k's prompt extends turn k-1's prompt + completion and the environment's tokens are
what follows. Templates that rewrite earlier assistant turns break that: Qwen3's drops their <think> blocks once a
new user query follows (and the empty think block of non-thinking mode), so turn k's prompt is shorter than turn
k-1's sequence and the same offset lands inside the model's text or past the start of the environment's.

Here the environment's part is the tail of turn k's prompt that the template renders after the previous assistant
turn ends: render the conversation twice with that assistant message's content replaced by two different stand-ins;
the renderings agree from the end of the content onwards (the assistant's closing, the environment's messages, the
generation prompt). Everything up to and including the end token the model sampled is the model's turn; the rest
is the environment's (the template's glue included, as when the prefix holds). It counts only when it tokenizes to
exactly the prompt's last tokens, so a template or argument the server used differently trains nothing rather than
the wrong tokens.
"""

from __future__ import annotations

import os

STAND_INS = ("\x01", "\x02")  # one character each, so the renderings part at the content's end


def extends(prompt_ids: list[int], previous: list[int]) -> bool:
    """Turn k's prompt starts with turn k-1's prompt + completion: the template kept history as sampled."""
    return len(prompt_ids) >= len(previous) and prompt_ids[: len(previous)] == previous


def common_suffix(a: str, b: str) -> str:
    return a[len(a) - len(os.path.commonprefix([a[::-1], b[::-1]])) :]


def after_turn(context: list[dict], boundary: int, render) -> str:
    """The text `render(messages)` puts after the content of assistant message `boundary` of `context`."""
    tails = []
    for stand_in in STAND_INS:
        messages = list(context)
        messages[boundary] = {**context[boundary], "content": stand_in}
        tails.append(render(messages))
    return common_suffix(*tails)


def environment_part(tail: str, end_text: str | None) -> str:
    """The part of `tail` after the model's turn: past `end_text`, the end token the model sampled (the template
    renders it after the content and any tool calls). A turn that ended without one (a stop string, a length cut)
    is followed directly by the template's closing, which the model did not write either."""
    if end_text and end_text in tail:
        return tail[tail.index(end_text) + len(end_text) :]
    return tail


def environment_tokens(
    tokenizer,
    context: list[dict],
    boundary: int,
    prompt_ids: list[int],
    previous_completion: list[int],
    template_kwargs: dict | None = None,
) -> int | None:
    """How many of `prompt_ids`' last tokens the environment (and the template's glue) put after the model's turn
    `boundary` of `context` (turn k's prompt messages); None when the rendering does not match `prompt_ids`."""
    kwargs = dict(template_kwargs or {})

    def render(messages):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)

    last = previous_completion[-1] if previous_completion else None
    end_text = special_text(tokenizer, last)
    if end_text is None and context[boundary].get("tool_calls"):
        return None  # its tool calls are rendered after the content with nothing to tell them from what follows
    try:
        text = environment_part(after_turn(context, boundary, render), end_text)
    except Exception:  # noqa: BLE001 - a template that cannot render these messages leaves the turn unmatched
        return None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
    if len(ids) > len(prompt_ids) or prompt_ids[len(prompt_ids) - len(ids) :] != ids:
        return None
    return len(ids)


def special_text(tokenizer, token_id: int | None) -> str | None:
    """The text of `token_id` when it is a special added token (an end of turn), else None."""
    added = tokenizer.added_tokens_decoder.get(token_id) if token_id is not None else None
    return str(added) if added is not None and added.special else None
