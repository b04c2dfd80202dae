"""mask_env_responses=False trains exactly the environment's tokens, on the byte kit (history re-rendered as sampled)
and the Qwen kit (Qwen3-style template: earlier reasoning dropped, the empty think block of non-thinking mode)."""

from __future__ import annotations

import math

import pytest

from verifiers_rl.batch.samples import build_samples
from verifiers_rl.rollouts.env_tokens import after_turn, common_suffix, environment_part, extends
from verifiers_rl.rollouts.rollouts import rollouts_from_outputs

SYSTEM = {"role": "system", "content": "Keep the list sorted."}
ASK = {"role": "user", "content": "Sort: pear, fig"}
MORE = {"role": "user", "content": "Add: apple"}
CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "fig"}'}}


def _render_ids(tok, messages, **kwargs):
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)["input_ids"]


def _exchange(tok, reply_texts, env_messages, assistant_messages, **kwargs):
    """A two-turn rollout as the server and verifiers record it: each turn's prompt is the template's rendering of
    the conversation so far, each completion the tokens of the model's text and its end token; the assistant
    messages are what the client parsed out of that text."""
    prompt = [SYSTEM, ASK]
    completion = [assistant_messages[0], *env_messages, assistant_messages[1]]
    turns, history = [], list(prompt)
    for k, text in enumerate(reply_texts):
        ids = _render_ids(tok, history, **kwargs)
        reply = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        turns.append(
            {
                "tokens": {
                    "prompt_ids": ids,
                    "completion_ids": reply,
                    "completion_mask": [1] * len(reply),
                    "completion_logprobs": [-0.5] * len(reply),
                }
            }
        )
        history += [assistant_messages[k], *(env_messages if k == 0 else [])]
    out = {"prompt": prompt, "completion": completion, "trajectory": turns, "reward": 1.0, "is_truncated": False}
    return rollouts_from_outputs([out], [0], policy_version=0)[0]


def _trained_env_text(tok, rollout, **kwargs):
    samples, counts = build_samples(
        [rollout], [1.0], [True], max_seq_len=4096, mask_env_responses=False, tokenizer=tok, chat_template_kwargs=kwargs
    )
    second = samples[1]
    n_prompt = len(rollout.turns[1].prompt_ids)
    env = [t for t, m in zip(second.input_ids[:n_prompt], second.loss_mask[:n_prompt]) if m]
    start = next(i for i, m in enumerate(second.loss_mask) if m)
    assert all(second.loss_mask[start:n_prompt]), "the environment's tokens are one span"
    assert all(math.isnan(x) for x in second.sampler_logprobs[start:n_prompt])
    assert second.loss_mask[n_prompt:] == [True] * len(rollout.turns[1].completion_ids)
    assert not any(samples[0].loss_mask[: len(rollout.turns[0].prompt_ids)])  # turn 0's prompt: never trained
    return tok.decode(env, skip_special_tokens=False), counts


ENV_TURN = "\n<|im_start|>user\nAdd: apple<|im_end|>\n<|im_start|>assistant\n"


def test_thinking_exchange_trains_the_users_turn(qwen_tokenizer):
    """The model thought, then answered; the next prompt drops its <think> block (a new user query follows). Prefix
    arithmetic trained only the last few tokens of the prompt (the issue: `<|im_start|>assistant\\n`)."""
    first = "<think>\nTwo fruits: fig before pear.\n</think>\n\nfig, pear"
    second = "<think>\napple first.\n</think>\n\napple, fig, pear"
    r = _exchange(
        qwen_tokenizer, [first, second], [MORE], [{"role": "assistant", "content": t} for t in (first, second)]
    )
    assert not extends(r.turns[1].prompt_ids, r.turns[0].prompt_ids + r.turns[0].completion_ids)
    text, counts = _trained_env_text(qwen_tokenizer, r)
    assert text == ENV_TURN
    assert counts["turns_history_rerendered"] == 1 and counts["turns_env_unmatched"] == 0


def test_non_thinking_exchange_trains_the_users_turn_and_the_empty_think_block(qwen_tokenizer):
    """enable_thinking=false: the generation prompt carries an empty think block that the re-rendered history leaves
    out (4 tokens), so prefix arithmetic missed the first four environment tokens."""
    first, second = "fig, pear", "apple, fig, pear"
    r = _exchange(
        qwen_tokenizer,
        [first, second],
        [MORE],
        [{"role": "assistant", "content": t} for t in (first, second)],
        enable_thinking=False,
    )
    text, counts = _trained_env_text(qwen_tokenizer, r, enable_thinking=False)
    assert text == ENV_TURN + "<think>\n\n</think>\n\n"
    assert counts["turns_history_rerendered"] == 1 and counts["turns_env_unmatched"] == 0


def test_without_the_runs_template_arguments_nothing_is_trained(qwen_tokenizer):
    """The server rendered with enable_thinking=false; rendered without it, the environment's part does not match
    the prompt's tokens: the turn trains none of them (counted) rather than the wrong ones."""
    r = _exchange(
        qwen_tokenizer,
        ["fig, pear", "apple, fig, pear"],
        [MORE],
        [{"role": "assistant", "content": t} for t in ("fig, pear", "apple, fig, pear")],
        enable_thinking=False,
    )
    samples, counts = build_samples(
        [r], [1.0], [True], max_seq_len=4096, mask_env_responses=False, tokenizer=qwen_tokenizer
    )
    assert not any(samples[1].loss_mask[: len(r.turns[1].prompt_ids)])
    assert counts["turns_env_unmatched"] == 1


def test_tool_exchange_trains_the_tool_results(qwen_tokenizer):
    """A hermes tool call answered by a tool message: the environment's part is the tool response the template
    wraps in a user turn. The tool message is no new query, so the thought is kept and the history holds."""
    call_text = (
        '<think>\nLook it up.\n</think>\n\n<tool_call>\n{"name": "lookup", "arguments": {"q": "fig"}}\n</tool_call>'
    )
    answer = "fig, pear"
    assistants = [
        {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [CALL]},
        {"role": "assistant", "content": answer},
    ]
    tool = {"role": "tool", "content": "a fruit", "tool_call_id": "c1"}
    r = _exchange(qwen_tokenizer, [call_text, answer], [tool], assistants)
    text, _ = _trained_env_text(qwen_tokenizer, r)
    assert text == "\n<|im_start|>user\n<tool_response>\na fruit\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_byte_kit_history_extends_and_trains_the_same_span(tiny_model_dir):
    """The byte kit's template keeps history as sampled: no turn is re-rendered, and the rendering finds the same
    span prefix arithmetic does."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    r = _exchange(tok, ["fig, pear", "apple, fig, pear"], [MORE], [{"role": "assistant", "content": "fig, pear"}] * 2)
    text, counts = _trained_env_text(tok, r)
    assert text == ENV_TURN
    assert counts["turns_history_rerendered"] == 0
    from verifiers_rl.rollouts.env_tokens import environment_tokens

    n = environment_tokens(
        tok, r.messages[: r.turns[1].message_index], 2, r.turns[1].prompt_ids, r.turns[0].completion_ids
    )
    assert tok.decode(r.turns[1].prompt_ids[-n:]) == ENV_TURN


def test_turns_that_do_not_pair_with_messages_train_no_environment_tokens(qwen_tokenizer):
    first = "<think>\nhm\n</think>\n\nfig, pear"
    r = _exchange(qwen_tokenizer, [first, "x"], [MORE], [{"role": "assistant", "content": first}] * 2)
    r.messages = None  # an environment whose completion does not line up with its turns
    samples, counts = build_samples(
        [r], [1.0], [True], max_seq_len=4096, mask_env_responses=False, tokenizer=qwen_tokenizer
    )
    assert not any(samples[1].loss_mask[: len(r.turns[1].prompt_ids)])
    assert counts["turns_env_unmatched"] == 1 and counts["turns_history_rerendered"] == 1


def test_masked_environment_counts_rerendered_turns_only(qwen_tokenizer):
    first = "<think>\nhm\n</think>\n\nfig, pear"
    r = _exchange(qwen_tokenizer, [first, "x"], [MORE], [{"role": "assistant", "content": first}] * 2)
    samples, counts = build_samples([r], [1.0], [True], max_seq_len=4096)
    assert not any(samples[1].loss_mask[: len(r.turns[1].prompt_ids)])
    assert counts["turns_history_rerendered"] == 1 and counts["turns_env_unmatched"] == 0


@pytest.mark.parametrize(
    ("a", "b", "suffix"), [("xa<e>u", "ya<e>u", "a<e>u"), ("abc", "abc", "abc"), ("x", "y", ""), ("", "q", "")]
)
def test_common_suffix(a, b, suffix):
    assert common_suffix(a, b) == suffix


def test_environment_part_starts_after_the_sampled_end_token():
    tail = "<e>\n<s>user\nhi<e>\n<s>assistant\n"
    assert environment_part(tail, "<e>") == "\n<s>user\nhi<e>\n<s>assistant\n"
    assert environment_part(tail, None) == tail  # no end token sampled: the template's closing is not the model's


def test_after_turn_is_what_follows_the_assistants_content():
    def render(messages):  # a template that rewrites the assistant's content before its closing
        return "".join(f"[{m['role']}]{m['content'].upper()}<e>" for m in messages) + "[assistant]"

    context = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "z"},
    ]
    assert after_turn(context, 1, render) == "<e>[user]Z<e>[assistant]"
