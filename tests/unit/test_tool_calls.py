import json

from verifiers_rl.inference.cpu.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_response,
    completion_choices,
    parse_tool_calls,
)
from verifiers_rl.inference.cpu.sampling import Completion
from verifiers_rl.tiny import build_tokenizer


def test_hermes_single_call():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert content is None
    assert len(calls) == 1 and calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == "add"
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert calls[0]["id"].startswith("chatcmpl-tool-")


def test_text_before_calls_is_content_and_several_calls_parse():
    text = (
        'Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n'
        '<tool_call>{"name": "mul", "arguments": "{\\"x\\": 2}"}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me add."
    assert [c["function"]["name"] for c in calls] == ["add", "mul"]
    assert calls[1]["function"]["arguments"] == '{"x": 2}'


def test_malformed_call_stays_text():
    text = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(text) == (text, [])


def test_chat_response_sets_tool_calls_finish_reason():
    tok = build_tokenizer()
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    ids = tok(text)["input_ids"] + [tok.eos_token_id]
    comp = Completion(ids, [-0.1] * len(ids), "stop", None, 3)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], tools=tools, return_token_ids=True, logprobs=True
    )
    body = chat_response(tok, "m", req, req.to_sampling_params(), [1, 2], [comp])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "add"
    assert choice["token_ids"] == ids and len(choice["logprobs"]["content"]) == len(ids)
    assert body["prompt_token_ids"] == [1, 2] and body["policy_version"] == 3
    # without tools in the request the text is returned as is
    req2 = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    plain = chat_response(tok, "m", req2, req2.to_sampling_params(), [1], [comp])["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"]["content"] == text


def test_unsupported_request_options_are_clear_errors():
    import pytest

    with pytest.raises(ValueError, match="stream=true is not supported"):
        ChatCompletionRequest(messages=[], stream=True).to_sampling_params()
    with pytest.raises(ValueError, match="top_p=0"):
        ChatCompletionRequest(messages=[], top_p=0).to_sampling_params()


def test_response_ids_are_unique_and_logprob_tokens_are_each_ids_text():
    tok = build_tokenizer()
    ids = tok("héllo wörld")["input_ids"] * 2  # repeated ids: the second of each comes from the per-id cache
    comp = Completion(ids, [-0.5] * len(ids), "length", None, 0)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True, tools=[])
    bodies = [chat_response(tok, "m", req, req.to_sampling_params(), [1], [comp]) for _ in range(3)]
    assert len({b["id"] for b in bodies}) == 3 and all(b["id"].startswith("chatcmpl-") for b in bodies)
    content = bodies[-1]["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert [c["bytes"] for c in content] == [list(c["token"].encode("utf-8")) for c in content]
    _, calls = parse_tool_calls('<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>')
    assert calls[0]["id"] != calls[1]["id"]
    # the completions route names the same tokens, with their offsets into the text
    creq = CompletionRequest(prompt=[1], logprobs=0)
    (choice,) = completion_choices(tok, creq, creq.to_sampling_params(), [1], [comp], 0)
    tokens = [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert choice["logprobs"]["tokens"] == tokens
    assert choice["logprobs"]["text_offset"] == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
