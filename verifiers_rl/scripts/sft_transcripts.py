"""Multi-turn SFT data from an environment's own turns (`vf-sft`'s `[dataset] replies = "module:function"`).

A multi-turn environment writes its user turns itself (`env_response`), often from what the model answered, so a
warm-start cannot be a fixed prompt -> answer table. Here the environment runs its ordinary rollout loop
(`env.generate`) against a client that answers every model call with the reference reply of that turn,
`replies(info)[turn]`: the transcripts are the ones the environment produces, its rubric scores them (the mean is
printed: a reference that does not score 1.0 is worth knowing about before training on it), and each assistant
turn becomes one prompt -> completion sample (the conversation before it -> its reply), the same unit RL trains on.
"""

from __future__ import annotations

import asyncio
import importlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from verifiers_rl.errors import ConfigError

Replies = Callable[[dict], Sequence[str]]


def load_replies(spec: str) -> Replies:
    """`"module:function"` -> the function (the environment's module is importable once it is installed)."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(
            f"dataset.replies = {spec!r}: expected 'module:function', e.g. 'alphabet_sort:reference_replies'"
        )
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"dataset.replies = {spec!r}: {e}") from None
    if not callable(fn):
        raise ConfigError(f"dataset.replies = {spec!r} is not a function")
    return fn


def _reference_client(replies: Replies):
    import verifiers as vf
    from verifiers.types import Response, ResponseMessage

    class ReferenceClient(vf.Client):
        """A `vf.Client` with no model behind it: turn t of a rollout gets `replies(state["info"])[t]`."""

        def __init__(self):
            super().__init__(None)

        def setup_client(self, config):
            return None

        async def to_native_tool(self, tool):
            return tool

        async def to_native_prompt(self, messages):
            return messages, {}

        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            state = kwargs["state"]
            turn = len(state["trajectory"])
            answers = replies(state["info"])
            if turn >= len(answers):
                raise ConfigError(
                    f"the replies function gave {len(answers)} replies; the environment asked for turn {turn + 1}"
                )
            return answers[turn]

        async def raise_from_native_response(self, response):
            return None

        async def from_native_response(self, text):
            message = ResponseMessage(content=text, finish_reason="stop", is_truncated=False)
            return Response(id="reference", created=int(time.time()), model="reference", message=message)

        async def close(self):
            return None

    return ReferenceClient()


def _message(m: Any) -> dict:
    get = m.get if isinstance(m, dict) else lambda k: getattr(m, k, None)
    return {"role": get("role"), "content": get("content")}


def per_turn_samples(prompt: Sequence[Any], completion: Sequence[Any]) -> list[dict]:
    """One {"prompt": conversation so far, "completion": [assistant reply]} per assistant message."""
    conversation = [_message(m) for m in [*prompt, *completion]]
    return [
        {"prompt": conversation[:i], "completion": [m]} for i, m in enumerate(conversation) if m["role"] == "assistant"
    ]


def transcript_samples(env, rows, replies: Replies) -> tuple[list[dict], float]:
    """Run `env` on `rows` with the reference replies; returns (per-turn samples, mean reward of the transcripts)."""
    inputs = [{**dict(row), "example_id": i} for i, row in enumerate(rows)]
    quiet = lambda *a, **k: None  # noqa: E731 - no progress bar for a client that answers instantly
    out = asyncio.run(env.generate(inputs, _reference_client(replies), "reference", on_start=quiet, on_progress=quiet))
    outputs = out["outputs"]
    errors = [o["error"] for o in outputs if o.get("error")]
    if errors:
        raise ConfigError(f"{len(errors)} reference transcripts failed; the first: {errors[0]}")
    samples = [s for o in outputs for s in per_turn_samples(o["prompt"], o["completion"])]
    reward = sum(o["reward"] for o in outputs) / max(len(outputs), 1)
    return samples, reward
