"""Per-request attention for the CPU engine (verifiers_rl.inference.cpu.model.varlen_attention): tensor-level checks
against the dense block-diagonal reference that transformers' continuous batching uses, plus the engine's
outputs with and without it."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from verifiers_rl.inference.cpu.model.varlen_attention import varlen_layout, varlen_sdpa


def dense_reference(q, k, v, cu_q, cu_k, scale=None):
    """What continuous batching computes: one packed row, a block-diagonal bottom-right causal mask."""
    tq, tk = cu_q[-1], cu_k[-1]
    mask = torch.zeros(tq, tk, dtype=torch.bool)
    for i in range(len(cu_q) - 1):
        ql, kl = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        for j in range(ql):
            mask[cu_q[i] + j, cu_k[i] : cu_k[i] + kl - ql + j + 1] = True
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask[None, None], scale=scale
    )
    return out.transpose(1, 2)  # [1, Tq, H, D]


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


@pytest.mark.parametrize(
    "q_lens, k_lens",
    [
        ([5, 3, 7], [5, 3, 7]),  # prefill of three prompts
        ([1, 1, 1, 1], [9, 4, 12, 1]),  # decode: one new token per request
        ([1, 6, 1, 3], [20, 6, 8, 10]),  # mixed: decodes, a prefill, a chunked prefill continuing a prompt
        ([1], [1]),
    ],
)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_matches_the_dense_block_diagonal_attention(q_lens, k_lens, heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    q = torch.randn(1, heads, cu_q[-1], 16, generator=g)
    k = torch.randn(1, kv_heads, cu_k[-1], 16, generator=g)
    v = torch.randn(1, kv_heads, cu_k[-1], 16, generator=g)
    out = varlen_sdpa(q, k, v, varlen_layout(cu_q, cu_k), scaling=0.3)
    ref = dense_reference(q, k, v, cu_q, cu_k, scale=0.3)
    assert out.shape == ref.shape == (1, cu_q[-1], heads, 16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_layout_costs_and_padding():
    lay = varlen_layout(_cu([1, 1, 1]), _cu([10, 2, 4]))
    assert lay["padded_cost"] == 3 * 1 * 10 and lay["dense_cost"] == 3 * 16
    # request 1 has two keys: the rest of its padded row is masked out
    assert lay["mask"][1, 0, 0].tolist() == [True, True] + [False] * 8
    assert lay["k_index"][1, :2].tolist() == [10, 11]


def test_engine_outputs_do_not_depend_on_the_attention_path(tiny_model_dir):
    from verifiers_rl.inference.cpu.cb_engine import CPUEngine
    from verifiers_rl.inference.cpu.sampling import SamplingParams
    from verifiers_rl.models import get_model, get_tokenizer

    tok = get_tokenizer(tiny_model_dir)
    prompts = [tok(f"{'abcdefgh'[: 1 + i % 8]} prompt {i}")["input_ids"] for i in range(12)]

    def run(attention):
        engine = CPUEngine(get_model(tiny_model_dir), tok, max_model_len=256, attention=attention)

        async def go():
            params = [SamplingParams(max_tokens=12, temperature=0.8, seed=i, ignore_eos=True) for i in range(12)]
            return await asyncio.gather(*[engine.generate(p, s) for p, s in zip(prompts, params)])

        try:
            return [c[0] for c in asyncio.run(go())]
        finally:
            engine.close()

    dense, varlen = run("sdpa"), run("varlen")
    assert [c.token_ids for c in dense] == [c.token_ids for c in varlen]
    for a, b in zip(dense, varlen):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    with pytest.raises(ValueError, match="attention='flash'; allowed: 'varlen', 'sdpa'"):
        CPUEngine(get_model(tiny_model_dir), tok, attention="flash")
