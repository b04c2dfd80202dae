"""Prompt lengths as the server sees them: chat template applied with the run's template arguments, the
environment's tool schemas included.

A length check that ignores tool schemas lets through prompts the server then rejects (HTTP 400) on every
request of a step, so the dataset filter and the empty-step diagnosis both measure through here. The request's
`chat_template_kwargs` change the rendering too (Qwen3's enable_thinking=false adds an empty think block: 4 tokens
to every prompt).
"""

from __future__ import annotations

import logging

from verifiers_rl.errors import TrainingError

logger = logging.getLogger(__name__)


def openai_tools(tool_defs) -> list[dict] | None:
    """verifiers tool definitions (vf.Tool objects or dicts) -> the OpenAI `tools` a chat request carries."""
    out = []
    for tool in tool_defs or []:
        if _field(tool, "type") == "function" and _field(tool, "function"):  # already in OpenAI's shape
            out.append(dict(tool))
            continue
        function = {k: _field(tool, k) for k in ("name", "description", "parameters")}
        out.append({"type": "function", "function": function})
    return out or None


def _field(tool, key: str):
    return tool.get(key) if isinstance(tool, dict) else getattr(tool, key, None)


def tools_for(env, row: dict | None = None) -> list[dict] | None:
    """The tools a rollout of `row` offers the model: the row's own `info.tool_defs`, else the environment's."""
    info = (row or {}).get("info")
    if isinstance(info, dict) and info.get("tool_defs"):
        return openai_tools(info["tool_defs"])
    return openai_tools(getattr(env, "tool_defs", None))


def template_kwargs(sampling_args: dict | None) -> dict:
    """The `chat_template_kwargs` a request with these sampling_args carries (vLLM's field; extra_body is merged
    over the top-level fields, as the OpenAI SDK sends it)."""
    args = sampling_args or {}
    extra = args.get("extra_body") or {}
    return {**(args.get("chat_template_kwargs") or {}), **(extra.get("chat_template_kwargs") or {})}


def prompt_length(tokenizer, prompt, tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> int:
    if isinstance(prompt, str):
        return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(
        list(prompt), tools=tools, add_generation_prompt=True, tokenize=True, **(chat_template_kwargs or {})
    )
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


def filter_prompts(
    dataset,
    tokenizer,
    max_prompt_len: int | None,
    env=None,
    *,
    fix: str = "raise max_seq_len (or server_max_model_len), or lower max_tokens / max_prompt_len",
    context: tuple[int, int | None] | None = None,
    chat_template_kwargs: dict | None = None,
):
    """Drop rows whose rendered prompt (with tool schemas and the run's `chat_template_kwargs`) exceeds
    max_prompt_len tokens, once, up front; return (rows, dropped). Every row dropped is a TrainingError that says how
    long the prompts are and `fix`. `context`: (the server's context, max_tokens), to say up front when a multi-turn
    environment's later turns cannot fit."""
    if max_prompt_len is None or dataset is None or "prompt" not in dataset.column_names:
        return dataset, 0
    lengths = [prompt_length(tokenizer, row["prompt"], tools_for(env, row), chat_template_kwargs) for row in dataset]
    keep_idx = [i for i, n in enumerate(lengths) if n <= max_prompt_len]
    dropped = len(dataset) - len(keep_idx)
    if dropped and not keep_idx:
        raise TrainingError(
            f"every one of the {len(dataset)} prompts is longer than the prompt limit of {max_prompt_len} tokens "
            f"(the shortest is {min(lengths):,} tokens with the chat template and tool schemas): {fix}"
        )
    if dropped:
        logger.warning(
            "filtered %d of %d prompts longer than %d tokens (chat template and tool schemas counted)",
            dropped,
            len(dataset),
            max_prompt_len,
        )
    if context is not None and keep_idx:
        note = later_turns_note(env, max(lengths[i] for i in keep_idx), *context)
        if note:
            logger.warning(note)
    return (dataset.select(keep_idx) if dropped else dataset), dropped


def filter_run_prompts(dataset, tokenizer, args, env):
    """`filter_prompts` with a run's prompt limit, server context and template arguments (RLConfig `args`)."""
    context, kwargs = (args.server_max_len, args.max_tokens), template_kwargs(args.sampling_args)
    return filter_prompts(dataset, tokenizer, args.prompt_limit, env, context=context, chat_template_kwargs=kwargs)


def later_turns_note(env, longest_prompt: int, context: int, max_tokens: int | None) -> str | None:
    """A multi-turn environment's second request carries the first turn: say up front when a full-length first
    completion leaves it no room (each such rollout then ends after its first turn, as truncated)."""
    turns = getattr(env, "max_turns", 1)
    if turns == 1 or not max_tokens or longest_prompt + 2 * max_tokens <= context:
        return None
    return (
        f"{type(env).__name__} is multi-turn (max_turns={turns}): each request carries the turns before it, and a "
        f"second turn needs the prompt (up to {longest_prompt} tokens) + the first completion (up to max_tokens="
        f"{max_tokens}) + the environment's reply + max_tokens={max_tokens}: more than the server's context of "
        f"{context} tokens. A rollout that outgrows the context ends at its last turn that fits, as truncated "
        "(rollouts_context_full counts them); raise max_seq_len (or server_max_model_len) to train later turns"
    )
