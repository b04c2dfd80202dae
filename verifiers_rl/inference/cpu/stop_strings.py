"""Stop strings, matched on the text the client sees (special tokens skipped as the request asks), as vLLM does."""

from __future__ import annotations


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
