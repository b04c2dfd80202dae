"""The lean request path builds the body the OpenAI SDK would send for verifiers' arguments."""

from __future__ import annotations

import json

from verifiers_rl.rl.trainer.rollout_client import chat_request_body, rollout_seed

MSGS = [{"role": "user", "content": "hi"}]


def test_body_renames_max_tokens_merges_extra_body_and_drops_none():
    body, headers = chat_request_body(
        "m",
        MSGS,
        {
            "max_tokens": 8,
            "temperature": 0.7,
            "top_p": None,
            "seed": 3,
            "extra_body": {"return_token_ids": True, "top_k": 5, "temperature": 0.9},
            "extra_headers": {"X-Session": "s1"},
        },
    )
    assert body == {
        "model": "m",
        "messages": MSGS,
        "max_completion_tokens": 8,
        "temperature": 0.9,  # extra_body wins, as in the SDK
        "seed": 3,
        "return_token_ids": True,
        "top_k": 5,
    }
    assert headers == {"X-Session": "s1"}
    json.dumps(body)


def test_body_carries_tools_only_when_given():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat_request_body("m", MSGS, {}, tools)[0]["tools"] == tools
    assert "tools" not in chat_request_body("m", MSGS, {}, [])[0]


def test_rollout_seed_is_stable_and_distinct():
    assert rollout_seed(0, "1:2:3", 0) == rollout_seed(0, "1:2:3", 0)
    assert len({rollout_seed(0, "1:2:3", t) for t in range(4)} | {rollout_seed(1, "1:2:3", 0)}) == 5
    assert 0 <= rollout_seed(5, "k", 9) < 2**47
