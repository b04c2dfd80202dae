"""The tiny Qwen kit: Qwen's real BPE, Qwen3's added tokens and rows, and a template that behaves like Qwen3's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verifiers_rl.errors import TrainingError
from verifiers_rl.rollouts.prompts import filter_prompts, prompt_length, template_kwargs
from verifiers_rl.tiny.qwen import ADDED_TOKENS, BPE_RANKS, MODEL_ROWS

USER = {"role": "user", "content": "Sort: pear, fig"}
THOUGHT = {"role": "assistant", "content": "<think>\nfig first\n</think>\n\nfig, pear"}
MORE = {"role": "user", "content": "Add: apple"}


def _render(tok, messages, **kwargs):
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


def test_real_bpe_and_added_token_ids(qwen_tokenizer):
    tok = qwen_tokenizer
    assert tok("Hello world")["input_ids"] == [9707, 1879]
    assert len(tok) == BPE_RANKS + len(ADDED_TOKENS) == 151_669
    ids = {text: tok.convert_tokens_to_ids(text) for text, _ in ADDED_TOKENS}
    assert ids["<|endoftext|>"] == 151_643 and ids["<|im_start|>"] == 151_644 and ids["<|im_end|>"] == 151_645
    assert ids["<tool_call>"] == 151_657 and ids["</tool_response>"] == 151_666 and ids["</think>"] == 151_668
    assert tok.eos_token_id == 151_645 and tok.pad_token_id == 151_643
    # think and tool tags are not special: a client reading the text with special tokens skipped still sees them
    text = "<think>\nhm\n</think>\n\nok<|im_end|>"
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == "<think>\nhm\n</think>\n\nok"
    assert tok.decode(tok("naïve café 数字 123")["input_ids"]) == "naïve café 数字 123"


def test_template_drops_reasoning_before_the_last_query(qwen_tokenizer):
    later = _render(qwen_tokenizer, [USER, THOUGHT, MORE], add_generation_prompt=True)
    assert later == (
        "<|im_start|>user\nSort: pear, fig<|im_end|>\n<|im_start|>assistant\nfig, pear<|im_end|>\n"
        "<|im_start|>user\nAdd: apple<|im_end|>\n<|im_start|>assistant\n"
    )
    # the same turn as the last one keeps its reasoning: the history is not a prefix of the next prompt
    kept = _render(qwen_tokenizer, [USER, THOUGHT])
    assert kept.endswith("<|im_start|>assistant\n<think>\nfig first\n</think>\n\nfig, pear<|im_end|>\n")
    assert not later.startswith(kept)


def test_last_assistant_turn_always_gets_a_think_block(qwen_tokenizer):
    plain = _render(qwen_tokenizer, [USER, {"role": "assistant", "content": "fig, pear"}])
    assert plain.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nfig, pear<|im_end|>\n")
    with_field = _render(qwen_tokenizer, [USER, {"role": "assistant", "content": "x", "reasoning_content": "\nwhy\n"}])
    assert with_field.endswith("<think>\nwhy\n</think>\n\nx<|im_end|>\n")


def test_enable_thinking_false_adds_an_empty_think_block(qwen_tokenizer):
    on = qwen_tokenizer.apply_chat_template([USER], add_generation_prompt=True)["input_ids"]
    off = qwen_tokenizer.apply_chat_template([USER], add_generation_prompt=True, enable_thinking=False)["input_ids"]
    assert off[: len(on)] == on
    assert qwen_tokenizer.decode(off[len(on) :]) == "<think>\n\n</think>\n\n" and len(off) - len(on) == 4


def test_hermes_tool_calls_and_grouped_tool_responses(qwen_tokenizer):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    calls = [
        {"id": "a", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
        {"id": "b", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}},
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        USER,
        {"role": "assistant", "content": "", "reasoning_content": "add twice", "tool_calls": calls},
        {"role": "tool", "content": "1", "tool_call_id": "a"},
        {"role": "tool", "content": "2", "tool_call_id": "b"},
    ]
    text = _render(qwen_tokenizer, messages, tools=tools, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "add"' in text
    # tool results are no new query: the reasoning of the calling turn stays
    assert (
        "<|im_start|>assistant\n<think>\nadd twice\n</think>\n\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in text
    # a user message that only carries tool output is not a query either
    wrapped = [USER, THOUGHT, {"role": "user", "content": "<tool_response>\n3\n</tool_response>"}]
    assert "<think>\nfig first\n</think>" in _render(qwen_tokenizer, wrapped, add_generation_prompt=True)


def test_saved_kit_loads_with_its_rows_and_both_end_tokens(qwen_model_dir):
    model = AutoModelForCausalLM.from_pretrained(qwen_model_dir)
    tok = AutoTokenizer.from_pretrained(qwen_model_dir)
    assert model.get_input_embeddings().num_embeddings == MODEL_ROWS and model.config.head_dim >= 32
    assert model.generation_config.eos_token_id == [151_645, 151_643]
    assert tok("Hello world")["input_ids"] == [9707, 1879] and len(tok) == 151_669
    assert tok.apply_chat_template([USER, THOUGHT, MORE], tokenize=False) == _render(
        AutoTokenizer.from_pretrained(qwen_model_dir), [USER, THOUGHT, MORE]
    )
    with torch.no_grad():
        logits = model(torch.tensor([[9707, 1879]])).logits
    assert logits.shape[-1] == MODEL_ROWS


def test_prompt_lengths_count_the_runs_template_arguments(qwen_tokenizer):
    """enable_thinking=false makes every prompt 4 tokens longer on the server; the length filter counts them."""
    from datasets import Dataset

    sampling = {
        "temperature": 1.0,
        "extra_body": {"return_token_ids": True, "chat_template_kwargs": {"enable_thinking": False}},
    }
    kwargs = template_kwargs(sampling)
    assert kwargs == {"enable_thinking": False}
    n = prompt_length(qwen_tokenizer, [USER])
    assert prompt_length(qwen_tokenizer, [USER], chat_template_kwargs=kwargs) == n + 4
    rows = Dataset.from_list([{"prompt": [USER]}, {"prompt": [USER, THOUGHT, MORE]}])
    with pytest.raises(TrainingError, match=f"the shortest is {n + 4} tokens"):
        filter_prompts(rows, qwen_tokenizer, n + 3, chat_template_kwargs=kwargs)
    kept, dropped = filter_prompts(rows, qwen_tokenizer, n + 4, chat_template_kwargs=kwargs)
    assert dropped == 1 and kept[0]["prompt"] == [USER]


@pytest.mark.parametrize(
    ("sampling", "expected"),
    [
        (None, {}),
        ({"chat_template_kwargs": {"enable_thinking": True, "x": 1}}, {"enable_thinking": True, "x": 1}),
        (
            {
                "chat_template_kwargs": {"enable_thinking": True},
                "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
            },
            {"enable_thinking": False},
        ),
    ],
)
def test_template_kwargs_as_the_request_sends_them(sampling, expected):
    assert template_kwargs(sampling) == expected
