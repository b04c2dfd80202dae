"""OpenAI-compatible request/response shapes, with vLLM's extra fields (see docs/protocol.md).

Responses carry what verifiers 0.1.14 reads for training: top-level `prompt_token_ids`, per-choice
`token_ids`, `logprobs.content[*].logprob` and `finish_reason` ("length" marks truncation).
"""

from __future__ import annotations

import itertools
import json
import re
import secrets
import time
import weakref
from collections import OrderedDict
from typing import Any

from pydantic import BaseModel, ConfigDict

from verifiers_rl.inference.cpu.sampling import Completion, SamplingParams

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# Response and tool-call ids: one random prefix per server process and a counter, unique as vLLM's uuid4 ids are.
# A uuid4 per response reads os.urandom, and that call gives the GIL to the engine loop's thread and waits its
# switch interval to take it back: 10 % of the HTTP thread's samples at 64 requests in flight (py-spy).
_ID_PREFIX = secrets.token_hex(6)
_ids = itertools.count()


def new_id(kind: str = "chatcmpl") -> str:
    return f"{kind}-{_ID_PREFIX}{next(_ids):012x}"


class _SamplingFields(BaseModel):
    # Unknown fields are accepted and ignored, as the OpenAI clients send vendor extras freely.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    stream: bool = False

    def sampling_params(self, max_tokens: int | None, logprobs: bool, top_logprobs: int) -> SamplingParams:
        if self.stream:
            raise ValueError("stream=true is not supported by the CPU engine; send stream=false")
        if top_logprobs:
            raise ValueError("top_logprobs > 0 is not supported by the CPU engine (logprobs of sampled tokens only)")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

        def pick(v, default):
            return default if v is None else v

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick(self.temperature, 1.0),
            top_p=pick(self.top_p, 1.0),
            top_k=pick(self.top_k, -1),
            min_p=pick(self.min_p, 0.0),
            repetition_penalty=pick(self.repetition_penalty, 1.0),
            presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0),
            seed=self.seed,
            n=self.n,
            stop=[s for s in stop if s],
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(
            self.max_completion_tokens or self.max_tokens, self.logprobs, self.top_logprobs or 0
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # legacy completions: number of top logprobs; 0 = sampled token only
    echo: bool = False

    def to_sampling_params(self) -> SamplingParams:
        if self.echo:
            raise ValueError("echo=true is not supported by the CPU engine")
        return self.sampling_params(self.max_tokens or 16, self.logprobs is not None, self.logprobs or 0)


def render_chat(tokenizer, req: ChatCompletionRequest) -> list[int]:
    # GRPO sends each prompt once per rollout of its group: render it once (the template is a pure function of
    # these inputs). The cache lives on the tokenizer, so a new model/tokenizer starts empty.
    key = json.dumps(
        [req.messages, req.tools, req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs],
        sort_keys=True,
        default=str,
    )
    cache = tokenizer.__dict__.setdefault("_vf_rendered_prompts", OrderedDict())
    if key in cache:
        cache.move_to_end(key)
        return list(cache[key])
    kwargs = dict(req.chat_template_kwargs or {})
    ids = tokenizer.apply_chat_template(
        req.messages,
        tools=req.tools,
        add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
        continue_final_message=req.continue_final_message,
        tokenize=True,
        **kwargs,
    )
    ids = tuple(ids["input_ids"] if hasattr(ids, "keys") else ids)
    cache[key] = ids
    if len(cache) > _RENDER_CACHE_SIZE:
        cache.popitem(last=False)
    return list(ids)


_RENDER_CACHE_SIZE = 4096


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks -> OpenAI tool_calls.

    Content is the text before the first tool call (None when empty). A block that is not valid JSON with a
    name stays in the content, so the environment sees what the model wrote.
    """
    calls = []
    for match in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(match.group(1))
            name = obj["name"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        args = obj.get("arguments", {})
        calls.append(
            {
                "id": new_id("chatcmpl-tool"),
                "type": "function",
                "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
        )
    if not calls:
        return text, []
    content = text[: text.find("<tool_call>")].strip()
    return (content or None), calls


def _text(tokenizer, c: Completion, params: SamplingParams) -> str:
    text = tokenizer.decode(c.token_ids, skip_special_tokens=params.skip_special_tokens)
    if isinstance(c.stop_reason, str) and not params.include_stop_str_in_output:
        text = text[: text.find(c.stop_reason)] if c.stop_reason in text else text
    return text


_TOKEN_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {token id: its text}


def _token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each id's own text, decoded once per token id and tokenizer: logprobs name every token of a response."""
    texts = _TOKEN_TEXTS.setdefault(tokenizer, {})
    for tid in ids:
        if tid not in texts:
            texts[tid] = tokenizer.decode([tid], skip_special_tokens=False)
    return [texts[tid] for tid in ids]


def _logprob_content(tokenizer, c: Completion) -> list[dict[str, Any]]:
    return [
        {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")), "top_logprobs": []}
        for tok, lp in zip(_token_texts(tokenizer, c.token_ids), c.logprobs)
    ]


def usage(prompt_ids: list[int], completions: list[Completion]) -> dict[str, int]:
    n = sum(len(c.token_ids) for c in completions)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}


def chat_response(
    tokenizer, model: str, req: ChatCompletionRequest, params: SamplingParams, prompt_ids, completions
) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(completions):
        text = _text(tokenizer, c, params)
        finish = c.finish_reason
        message: dict[str, Any] = {"role": "assistant", "content": text, "tool_calls": []}
        if req.tools and req.tool_choice != "none":
            content, calls = parse_tool_calls(text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls" if finish == "stop" else finish
        choice = {
            "index": i,
            "message": message,
            "logprobs": {"content": _logprob_content(tokenizer, c)} if params.logprobs else None,
            "finish_reason": finish,
            "stop_reason": c.stop_reason,
        }
        if req.return_token_ids:
            choice["token_ids"] = c.token_ids
        choices.append(choice)
    body = {
        "id": new_id(),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prompt_ids, completions),
        "policy_version": min(c.policy_version for c in completions),
    }
    if req.return_token_ids:
        body["prompt_token_ids"] = list(prompt_ids)
    return body


def completion_choices(
    tokenizer, req: CompletionRequest, params: SamplingParams, prompt_ids, completions, start: int
) -> list[dict[str, Any]]:
    choices = []
    for j, c in enumerate(completions):
        choice: dict[str, Any] = {
            "index": start + j,
            "text": _text(tokenizer, c, params),
            "logprobs": None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if params.logprobs:
            tokens = _token_texts(tokenizer, c.token_ids)
            offsets, pos = [], 0
            for t in tokens:
                offsets.append(pos)
                pos += len(t)
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": c.logprobs,
                "top_logprobs": None,
                "text_offset": offsets,
            }
        if req.return_token_ids:
            choice["prompt_token_ids"] = list(prompt_ids)
            choice["token_ids"] = c.token_ids
        choices.append(choice)
    return choices


def completion_prompts(tokenizer, prompt) -> list[list[int]]:
    """A completions `prompt` (text, token ids, or a batch of either) -> a list of token-id prompts."""
    if isinstance(prompt, str):
        return [tokenizer(prompt, add_special_tokens=False)["input_ids"]]
    if prompt and all(isinstance(x, int) for x in prompt):
        return [list(prompt)]
    out = []
    for p in prompt:
        out.append(tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else list(p))
    return out


def error_body(message: str, code: int = 400, kind: str = "BadRequestError") -> dict[str, Any]:
    return {"object": "error", "message": message, "type": kind, "param": None, "code": code}
