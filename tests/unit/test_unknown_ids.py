"""Ids the tokenizer does not have: Qwen3 models have 151,936 rows, the tokenizer 151,669 ids.

What Qwen3 checkpoints and vLLM do, and so what we do: the sampler draws over the model's full row (nothing masks
the 267 rows past the tokenizer), such a token decodes to "" and keeps its logprob, a prompt may carry one (vLLM
validates prompt ids against the model's rows), and the trainer scores every token over the same full row, so its
logprob of such a token equals the engine's. The next turn's prompt is rendered from the text, where the token left
nothing: that history is re-rendered, and the environment's tokens are still found (env_tokens.py).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from verifiers_rl.inference.cpu import slot_engine as se
from verifiers_rl.inference.cpu.protocol import ChatCompletionRequest, chat_response
from verifiers_rl.inference.cpu.sampling import SamplingParams
from verifiers_rl.loss.logprobs import chunked_logprobs
from verifiers_rl.tiny.qwen import MODEL_ROWS

USER = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def rows_past_the_tokenizer(qwen_model_dir):
    """A tiny Qwen whose LM head favours the rows the tokenizer lacks (an untrained model drew 4 of 768 there)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = (
        AutoModelForCausalLM.from_pretrained(qwen_model_dir).eval(),
        AutoTokenizer.from_pretrained(qwen_model_dir),
    )
    with torch.no_grad():
        head = model.lm_head.weight
        head[: len(tok)] = 0
        head[len(tok) :] *= 300
    return model, tok


def test_engine_samples_them_with_the_trainers_logprobs_and_they_decode_to_nothing(rows_past_the_tokenizer):
    model, tok = rows_past_the_tokenizer
    prompt = tok.apply_chat_template(USER, add_generation_prompt=True)["input_ids"]
    engine = se.SlotEngine(model, tok, max_model_len=64, max_num_seqs=2)
    try:

        async def go():
            return await engine.generate(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=0))

        (c,) = asyncio.run(go())
        # a prompt holding such an id is served too (vLLM checks prompt ids against the model's rows)
        (again,) = asyncio.run(engine.generate(prompt + c.token_ids[:1], SamplingParams(max_tokens=1, seed=1)))
    finally:
        engine.close()
    assert all(len(tok) <= t < MODEL_ROWS for t in c.token_ids), c.token_ids
    assert len(again.token_ids) == 1
    with torch.no_grad():
        out = model(torch.tensor([prompt + c.token_ids]), output_hidden_states=True)
        hidden = out.hidden_states[-1][0, len(prompt) - 1 : -1]
        trained, _ = chunked_logprobs(hidden, model.lm_head.weight, torch.tensor(c.token_ids), with_entropy=False)
    torch.testing.assert_close(torch.tensor(c.logprobs), trained, atol=1e-4, rtol=0)

    req = ChatCompletionRequest(messages=USER, logprobs=True)
    body = chat_response(tok, "m", req, req.to_sampling_params(), prompt, [c])
    choice = body["choices"][0]
    assert choice["message"]["content"] == ""
    assert [e["token"] for e in choice["logprobs"]["content"]] == [""] * len(c.token_ids)
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == c.logprobs


def test_a_turn_after_such_tokens_still_trains_the_environments_tokens(qwen_tokenizer):
    """The reply "ok" with a row past the tokenizer in the middle: its text is "ok", so the next prompt does not
    hold that token (history re-rendered), and the user's turn is what the environment trained."""
    from verifiers_rl.batch.samples import build_samples
    from verifiers_rl.rollouts.rollouts import rollouts_from_outputs

    tok = qwen_tokenizer
    ok = tok("ok", add_special_tokens=False)["input_ids"]
    reply = [ok[0], 151_800, *ok[1:], tok.eos_token_id]
    assert tok.decode(reply, skip_special_tokens=True) == "ok"
    prompt, more = USER, {"role": "user", "content": "More."}
    history = [*prompt, {"role": "assistant", "content": "ok"}, more]
    turns = []
    for messages, completion in ((prompt, reply), (history, ok + [tok.eos_token_id])):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        n = len(completion)
        turns.append({"tokens": {"prompt_ids": ids, "completion_ids": completion, "completion_mask": [1] * n,
                                 "completion_logprobs": [-1.0] * n}})  # fmt: skip
    out = {"prompt": prompt, "completion": history[1:] + [{"role": "assistant", "content": "ok"}], "trajectory": turns}
    (r,) = rollouts_from_outputs([{**out, "reward": 1.0, "is_truncated": False}], [0], 0)
    samples, counts = build_samples([r], [1.0], [True], max_seq_len=512, mask_env_responses=False, tokenizer=tok)
    n = len(r.turns[1].prompt_ids)
    env = [t for t, m in zip(samples[1].input_ids[:n], samples[1].loss_mask[:n]) if m]
    assert tok.decode(env) == "\n<|im_start|>user\nMore.<|im_end|>\n<|im_start|>assistant\n"
    assert counts["turns_history_rerendered"] == 1 and counts["turns_env_unmatched"] == 0
