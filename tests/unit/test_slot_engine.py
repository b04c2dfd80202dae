"""The slot engine (verifiers_rl.inference.cpu.slot_engine) and its parts: tensor-level checks of the lean forward's
math against transformers' modules, the slot KV cache, and the engine's outputs against a teacher-forced HF
forward pass (exactness, seeds, n > 1, stop strings, weight updates, slot reuse, preemption, failures)."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F
from decoders import decoder

from verifiers_rl.inference.cpu import slot_engine as se
from verifiers_rl.inference.cpu.cb_engine import CPUEngine
from verifiers_rl.inference.cpu.engine_api import EngineError
from verifiers_rl.inference.cpu.engines import create_engine
from verifiers_rl.inference.cpu.model import lean_forward
from verifiers_rl.inference.cpu.model.kv_cache import DEFAULT_CACHE_BYTES, SlotKVCache, token_budget
from verifiers_rl.inference.cpu.model.lean_forward import (
    LeanDecoder,
    apply_rope,
    cache_rows,
    decode_mask,
    rms_norm,
    rope_tables,
    unsupported_reason,
)
from verifiers_rl.inference.cpu.sampling import SamplingParams, UniformStream, request_generator
from verifiers_rl.tiny import build_tiny_model, build_tokenizer

# ------------------------------------------------------------------------------------------ pure functions


def test_rope_matches_transformers():
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    cos, sin = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)  # [B, heads, T, D], cos [B, T, D]
    c, s = rope_tables(cos, sin)
    torch.testing.assert_close(apply_rope(q, c[:, None], s[:, None]), ref_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(apply_rope(k, c[:, None], s[:, None]), ref_k, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2, 16))
    norm = norm.to(dtype)
    x = torch.randn(3, 4, 16).to(dtype)
    torch.testing.assert_close(rms_norm(x, norm.weight, 1e-6), norm(x))


def test_decode_mask_and_cache_rows():
    mask = decode_mask(torch.tensor([0, 2]), 2, 4, torch.float32)  # rows (b, kv head): 2 x 2
    assert mask.shape == (4, 1, 4)
    assert torch.isinf(mask[:, 0]).tolist() == [[False, True, True, True]] * 2 + [[False, False, False, True]] * 2
    cache = torch.zeros(3, 2, 5, 4)  # [slots, kv heads, length, D]
    keys = torch.randn(2, 1, 2, 4)  # [B, T, kv heads, D]
    slots, positions = torch.tensor([2, 0]), torch.tensor([[3], [1]])
    cache.view(-1, 4).index_copy_(0, cache_rows(slots, positions, 2, 5), keys.reshape(-1, 4))
    assert torch.equal(cache[2, :, 3], keys[0, 0]) and torch.equal(cache[0, :, 1], keys[1, 0])
    assert (cache != 0).sum() == keys.numel()  # nothing else written


def test_kv_cache_grows_keeps_contents_and_respects_budget():
    cache = SlotKVCache(2, 1, 4, max_slots=8, max_length=256, budget_tokens=512)
    cache.k[0][1, 0, 5, 2] = 7.0
    cache.ensure(3, 100)
    assert cache.slots >= 3 and cache.length >= 100 and cache.k[0][1, 0, 5, 2] == 7.0
    assert cache.slots * cache.length <= 512
    assert cache.fits(4, 128) and not cache.fits(5, 128) and not cache.fits(1, 300) and not cache.fits(9, 1)
    with pytest.raises(ValueError, match="exceed"):
        cache.ensure(8, 128)
    cache.copy(1, 0, 6)
    assert cache.k[0][0, 0, 5, 2] == 7.0


def test_uniform_stream_depends_only_on_the_seed():
    a, b = UniformStream(request_generator(3)), UniformStream(request_generator(3))
    xs = [a.next() for _ in range(300)]  # crosses a chunk refill
    assert xs == [b.next() for _ in range(300)]
    assert all(0 <= x < 1 for x in xs) and len(set(xs)) == 300


# ------------------------------------------------------------------------------------------ lean forward vs HF


@pytest.mark.parametrize("kernel", ["f_linear", "onednn"])
@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama3-mha"])
def test_prefill_and_decode_logits_match_hf(kind, kernel, monkeypatch):
    if kernel == "onednn":  # every weight through oneDNN, as a real model's large ones are
        if not lean_forward._ONEDNN:
            pytest.skip("this torch build has no oneDNN linear")
        monkeypatch.setattr(lean_forward, "ONEDNN_MIN_ELEMENTS", 0)
    model = decoder(kind)
    assert unsupported_reason(model) is None
    dec = LeanDecoder(model, 128)
    cfg = model.config
    cache = SlotKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, dec.head_dim, max_slots=4, max_length=128)
    cache.ensure(3, 40)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 261, (n,), generator=g) for n in (7, 12, 3)]
    prompt = [s[:-4] if len(s) > 5 else s[:1] for s in seqs]
    tokens = torch.zeros(3, max(len(p) for p in prompt), dtype=torch.long)
    for i, p in enumerate(prompt):
        tokens[i, : len(p)] = p
    first = dec.prefill(tokens, torch.tensor([len(p) for p in prompt]), cache, 0)
    with torch.no_grad():
        refs = [model(s[None]).logits[0] for s in seqs]
    for i, p in enumerate(prompt):
        torch.testing.assert_close(first[i], refs[i][len(p) - 1], atol=1e-5, rtol=1e-5)
    # decode the rest one token per step, rows at different positions
    pos = [len(p) for p in prompt]
    while any(pos[i] < len(seqs[i]) for i in range(3)):
        live = [i for i in range(3) if pos[i] < len(seqs[i])]
        # decode runs contiguous slots: feed every row, check the live ones
        toks = torch.tensor([seqs[i][min(pos[i], len(seqs[i]) - 1)] for i in range(3)])
        out = dec.decode(toks, torch.tensor([min(pos[i], len(seqs[i]) - 1) for i in range(3)]), cache, 0)
        for i in live:
            torch.testing.assert_close(out[i], refs[i][pos[i]], atol=1e-5, rtol=1e-5)
            pos[i] += 1


def test_onednn_linear_is_f_linear_and_takes_large_weights_only(monkeypatch):
    calls = []
    real = torch.ops.mkldnn._linear_pointwise if lean_forward._ONEDNN else None
    if real is None:
        pytest.skip("this torch build has no oneDNN linear")
    x, w, b = torch.randn(3, 5, 1024), torch.randn(512, 1024), torch.randn(512)
    monkeypatch.setattr(lean_forward.torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        torch.testing.assert_close(lean_forward.linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
        assert calls == [1]  # 512K elements: oneDNN
        small = w[:256].contiguous()
        torch.testing.assert_close(lean_forward.linear(x, small), F.linear(x, small))
        lean_forward.linear(x, torch.randn(1024, 512).t())  # a transposed view is left to F.linear
        lean_forward.linear(x.double(), w.double())  # and so is fp64
    assert calls == [1]


def test_weights_stay_the_models_parameters():
    model = build_tiny_model(hidden=64, layers=2)[0]
    dec = LeanDecoder(model, 64)
    attn = model.model.layers[0].self_attn
    q = attn.q_proj.weight
    with torch.no_grad():
        q.add_(1.0)  # an in-place update through named_parameters() reaches the packed buffer
        attn.q_norm.weight.mul_(2.0)  # and the derived q/k-norm weight follows its parameters
    assert torch.equal(dec.w[0].qkv_w[: q.shape[0]], q)
    assert torch.equal(dec.w[0].qk_weight()[0], attn.q_norm.weight)
    attn.q_proj.weight.data = q.detach().clone()  # replaced storage: repacked
    assert not dec.w[0].packed_valid()
    dec.check_weights()
    assert dec.w[0].packed_valid()


def test_unsupported_models_fall_back_to_continuous_batching(caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=261, n_embd=32, n_layer=1, n_head=2)).eval()
    assert "gpt2" in unsupported_reason(model)
    with pytest.raises(ValueError, match="does not support"):
        create_engine(model, build_tokenizer(), impl="slots")
    # a supported family with a feature the lean forward lacks: transformers' continuous batching, logged
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=261, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, use_sliding_window=True, sliding_window=16,
                      layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    with caplog.at_level("WARNING", logger="verifiers_rl.inference.cpu.engines"):
        eng = create_engine(Qwen3ForCausalLM(cfg).eval(), build_tokenizer(), max_model_len=64, max_num_seqs=2)
    try:
        assert isinstance(eng, CPUEngine) and "sliding-window layers" in caplog.text
    finally:
        eng.close()


# ------------------------------------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model(hidden=64, layers=2)


@pytest.fixture
def engine(tiny):
    model, tok = build_tiny_model(hidden=64, layers=2)
    eng = se.SlotEngine(model, tok, max_model_len=128, max_num_seqs=8)
    yield eng
    eng.close()


def _prompt(tok, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]


def _teacher_forced(model, prompt, ids, temperature=1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1), logits


def _run(engine, jobs):
    async def go():
        return await asyncio.gather(*(engine.generate(p, s) for p, s in jobs))

    return asyncio.run(go())


def test_logprobs_equal_teacher_forced_hf_at_temperature(engine, tiny):
    model, tok = tiny
    jobs = [
        (_prompt(tok, f"q{i} " * (i + 1)), SamplingParams(max_tokens=16, temperature=0.7, seed=i)) for i in range(6)
    ]
    for (p, _), out in zip(jobs, _run(engine, jobs)):
        c = out[0]
        ref, _ = _teacher_forced(model, p, c.token_ids, 0.7)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4), (torch.tensor(c.logprobs) - ref).abs().max()


def test_greedy_equals_hf_generate(engine, tiny):
    model, tok = tiny
    p = _prompt(tok, "Reverse: hello")
    c = _run(engine, [(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))])[0][0]
    with torch.no_grad():
        ref = model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert c.token_ids == ref[0, len(p) :].tolist()


def test_seeded_requests_do_not_depend_on_batch_neighbours(engine, tiny):
    _, tok = tiny
    p = _prompt(tok, "seeded")
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=42, ignore_eos=True)
    alone = _run(engine, [(p, params)])[0][0].token_ids
    crowd = [(_prompt(tok, f"other {i}"), SamplingParams(max_tokens=30, seed=i, ignore_eos=True)) for i in range(6)]
    together = _run(engine, crowd[:3] + [(p, params)] + crowd[3:])[3][0].token_ids
    assert alone == together


def test_n_choices_share_the_prompt_and_stay_exact(engine, tiny):
    model, tok = tiny
    p = _prompt(tok, "group")
    choices = _run(engine, [(p, SamplingParams(max_tokens=10, n=4, seed=5, ignore_eos=True))])[0]
    assert len({tuple(c.token_ids) for c in choices}) > 1
    for c in choices:  # copied prompt keys/values give the same logprobs as a prefill of their own
        ref, _ = _teacher_forced(model, p, c.token_ids)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)
    # a later request for the same prompt while one holder still runs reuses it; same seed, same tokens
    again = _run(engine, [(p, SamplingParams(max_tokens=10, n=4, seed=5, ignore_eos=True))])[0]
    assert [c.token_ids for c in again] == [c.token_ids for c in choices]


def test_stop_strings_and_stop_token_ids(engine, tiny):
    _, tok = tiny
    p = _prompt(tok, "stop here")
    full = _run(engine, [(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))])[0][0]
    text = tok.decode(full.token_ids)
    stop = next((ch for ch in text[2:] if ch.isascii() and ch.isprintable() and ch.strip()), None)
    if stop is None:
        pytest.skip("greedy text has no printable ASCII to stop on")
    c = _run(engine, [(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]))])[0][0]
    assert c.finish_reason == "stop" and c.stop_reason == stop and stop in tok.decode(c.token_ids)
    assert full.token_ids[: len(c.token_ids)] == c.token_ids and len(c.logprobs) == len(c.token_ids)
    tid = full.token_ids[3]
    c = _run(engine, [(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[tid]))])[0][0]
    assert c.token_ids[-1] == tid and c.stop_reason == tid and c.finish_reason == "stop"


def test_weight_update_then_generation_uses_new_weights(engine, tiny):
    _, tok = tiny
    new, _ = build_tiny_model(hidden=64, layers=2, seed=1)
    p = _prompt(tok, "weights")
    _run(engine, [(p, SamplingParams(max_tokens=4, seed=0))])  # the prompt is now cached for sharing
    engine.pause()
    assert engine.load_weights(new.named_parameters()) == len(list(new.parameters()))
    assert engine.finish_update(1) == 1  # the trainer names the version; the engine never counts
    engine.resume()
    c = _run(engine, [(p, SamplingParams(max_tokens=12, temperature=0.8, seed=3))])[0][0]
    ref, _ = _teacher_forced(new, p, c.token_ids, 0.8)
    assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)
    assert c.policy_version == 1


def test_adapter_sync_writes_through_the_packed_views():
    """vf_lora_update's path (W = W0 + B @ A on the pristine base) and a merged sync land in the packed q/k/v and
    gate/up buffers the forward reads; the pristine copies are the base, not views of the live weights."""
    from peft_models import lora_model

    from verifiers_rl.sync.policy_weights import adapter_weights, merged_weights
    from verifiers_rl.sync.transport.adapter import lora_module

    model, tok = build_tiny_model()  # the base of lora_model(seed=0)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    eng = se.SlotEngine(model, tok, max_model_len=128, max_num_seqs=4)
    peft = lora_model(seed=0).eval()
    p = _prompt(tok, "adapter")
    try:
        for factor in (1.0, 0.0):  # a zero adapter gives back the base, bit for bit
            named = [
                (".".join(lora_module(n)), t * (factor if ".lora_B" in n else 1.0)) for n, t in adapter_weights(peft)
            ]
            eng.pause()
            assert eng.load_weights(named, lora_scaling=1.0) == len(named) // 2
            eng.finish_update()
            eng.resume()
            c = _run(eng, [(p, SamplingParams(max_tokens=12, seed=1, ignore_eos=True))])[0][0]
            if factor:
                ref, _ = _teacher_forced(peft, p, c.token_ids)
                attn = model.model.layers[0].self_attn
                assert torch.equal(eng.decoder.w[0].qkv_w[: attn.q_proj.weight.shape[0]], attn.q_proj.weight)
                assert not torch.equal(attn.q_proj.weight, base["model.layers.0.self_attn.q_proj.weight"])
            else:
                ref, _ = _teacher_forced(build_tiny_model()[0], p, c.token_ids)
                assert all(torch.equal(t, base[n]) for n, t in model.named_parameters())
            assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4), (
                (torch.tensor(c.logprobs) - ref).abs().max()
            )
        eng.load_weights(merged_weights(peft))  # merged: a plain copy into the views
        c = _run(eng, [(p, SamplingParams(max_tokens=12, seed=2, ignore_eos=True))])[0][0]
        ref, _ = _teacher_forced(peft, p, c.token_ids)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)
    finally:
        eng.close()


def test_buckets_of_a_sync_arrive_in_the_served_parameters():
    """The engine's parameters live in one buffer in named_parameters() order, so each tensor of a bucket of the
    trainer's sync has a place there (received there, or copied there from the shared-memory slot, with no staging);
    the forward reads that memory, q/k/v and gate/up included. A bucket in another order still lands tensor by
    tensor; one over a parameter whose storage was replaced since is staged and copied instead."""
    from verifiers_rl.sync.buckets import TensorMeta, pack, plan_buckets
    from verifiers_rl.sync.transport.wire import end_to_end, scatter

    model, tok = build_tiny_model(hidden=64, layers=2)
    new, _ = build_tiny_model(hidden=64, layers=2, seed=1)
    eng = se.SlotEngine(model, tok, max_model_len=128, max_num_seqs=2)
    try:
        named = list(new.named_parameters())
        metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in named]
        eng.pause()
        for bucket in plan_buckets(metas, 1 << 16):
            target = eng.placement(bucket)
            assert target is not None and [t.numel() for t in target] == [m.nbytes for m in bucket.metas]
            # the engine's buffer holds the parameters end to end in this order, as the bucket does
            assert end_to_end(bucket, target) is not None
            scatter(bucket, pack(bucket, [dict(named)[m.name] for m in bucket.metas]), target)  # what gloo delivers
        eng.finish_update(1)
        eng.resume()
        assert all(torch.equal(p, dict(named)[n]) for n, p in model.named_parameters())
        p = _prompt(tok, "in place")
        c = _run(eng, [(p, SamplingParams(max_tokens=8, seed=0, ignore_eos=True))])[0][0]
        ref, _ = _teacher_forced(new, p, c.token_ids)
        assert torch.allclose(torch.tensor(c.logprobs), ref, atol=1e-4)
        swapped = plan_buckets([metas[1], metas[0]], 1 << 20)[0]
        eng.pause()
        target = eng.placement(swapped)
        assert end_to_end(swapped, target) is None  # not end to end in that order
        zeros = [torch.zeros_like(dict(named)[m.name]) for m in swapped.metas]
        scatter(swapped, pack(swapped, zeros), target)
        assert all(not dict(model.named_parameters())[m.name].any() for m in swapped.metas)
        eng.resume()
        attn = model.model.layers[0].self_attn
        attn.q_proj.weight.data = attn.q_proj.weight.detach().clone()
        q = plan_buckets([m for m in metas if m.name == "model.layers.0.self_attn.q_proj.weight"], 1 << 20)[0]
        assert eng.placement(q) is None
    finally:
        eng.close()


def test_threads_size_the_loop_threads_team_only():
    """The server gives the loop thread its intra-op threads (app.serve); the caller's own count stays."""
    model, tok = build_tiny_model(hidden=64, layers=2)
    engine = se.SlotEngine(model, tok, max_model_len=64, max_num_seqs=2)
    before = torch.get_num_threads()
    want = 2 if before == 1 else 1
    try:
        engine.threads = want
        out = asyncio.run(engine.generate([5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0)))
        assert len(out[0].token_ids) == 2
        assert engine.loop_threads == want
        assert torch.get_num_threads() == before
    finally:
        engine.close()


def test_control_threads_keep_one_intra_op_thread_when_the_loop_sets_more():
    """The server's control pool threads (app.py) stay at one thread after another thread raised torch's
    process-wide count: otherwise their first large op would build a second OpenMP team next to the loop's."""
    import threading

    from verifiers_rl.inference.cpu.app import _one_intra_op_thread

    before = torch.get_num_threads()
    seen, ready, go = {}, threading.Event(), threading.Event()

    def control():
        _one_intra_op_thread()
        ready.set()
        go.wait(10)
        torch.ones(1 << 22).sum()  # large enough to run in parallel
        seen["threads"] = torch.get_num_threads()

    t = threading.Thread(target=control)
    t.start()
    try:
        ready.wait(10)
        torch.set_num_threads(2)  # what the loop thread does: it sets the process-wide count too
        go.set()
        t.join(10)
        assert seen["threads"] == 1
    finally:
        torch.set_num_threads(before)


def test_engine_threads_rule():
    from verifiers_rl.inference.cpu.app import ALL_CORES_WEIGHT_BYTES, engine_threads

    assert engine_threads(10 << 20, cores=2) == 1  # the demos' tiny models: the event loop keeps a core
    assert engine_threads(ALL_CORES_WEIGHT_BYTES, cores=2) == 2  # bandwidth-bound decode: every core
    assert engine_threads(10 << 20, cores=16) == 15
    assert engine_threads(ALL_CORES_WEIGHT_BYTES - 1, cores=1) == 1
    assert engine_threads(ALL_CORES_WEIGHT_BYTES, cores=1) == 1


def test_slots_are_reused_and_queued_requests_wait(tiny):
    model, tok = build_tiny_model(hidden=64, layers=2)
    eng = se.SlotEngine(model, tok, max_model_len=128, max_num_seqs=3)
    try:
        jobs = [
            (_prompt(tok, f"job {i}"), SamplingParams(max_tokens=4 + 3 * i, seed=i, ignore_eos=True)) for i in range(8)
        ]
        outs = _run(eng, jobs)
        assert [len(o[0].token_ids) for o in outs] == [4 + 3 * i for i in range(8)]
        for (p, _), o in zip(jobs, outs):
            ref, _ = _teacher_forced(tiny[0], p, o[0].token_ids)
            assert torch.allclose(torch.tensor(o[0].logprobs), ref, atol=1e-4)
        assert eng.cache.slots <= 3 and not eng._running and not eng._waiting
    finally:
        eng.close()


def test_kv_budget_is_bounded_in_bytes_not_by_a_fraction_of_the_maximum():
    qwen3_06b = 2 * 28 * 8 * 128 * 4  # keys and values, 28 layers x 8 KV heads x 128 dims, fp32: 224 KiB per token
    assert token_budget(DEFAULT_CACHE_BYTES, qwen3_06b, 64, 4096) == (4 << 30) // qwen3_06b  # ~18.7k tokens, 4 GiB
    assert token_budget(DEFAULT_CACHE_BYTES, 1024, 64, 128) == 64 * 128  # a tiny model: every slot at full length
    assert token_budget(10, 1024, 64, 128) == 1  # never zero (SlotKVCache keeps one full-length sequence anyway)


def test_a_batch_of_64_decodes_together_at_a_short_max_model_len():
    """The RL demos serve max_model_len = max_seq_len (128): a 64-rollout batch must run as one batch of 64, not
    in waves of 16 (the old budget, a quarter of max_num_seqs x max_model_len tokens, allowed 2048)."""
    model, tok = build_tiny_model(hidden=64, layers=2)
    eng = se.SlotEngine(model, tok, max_model_len=128, max_num_seqs=64)
    try:
        prompts = [_prompt(tok, f"reverse {g} abc") for g in range(8)]  # 8 prompts x 8 rollouts, like GRPO
        jobs = [(prompts[i // 8], SamplingParams(max_tokens=48, seed=i, ignore_eos=True)) for i in range(64)]
        outs = _run(eng, jobs)
        assert all(len(o[0].token_ids) == 48 for o in outs)
        assert eng.cache.slots == 64  # every sequence held a slot at once
    finally:
        eng.close()


def test_preempted_sequences_resume_exactly(tiny):
    """A KV budget too small for everyone: the last slots go back to the queue and are prefilled again later."""
    model, tok = build_tiny_model(hidden=64, layers=2)
    eng = se.SlotEngine(model, tok, max_model_len=256, max_num_seqs=4, kv_cache_tokens=256)
    try:
        jobs = [(_prompt(tok, f"long {i}"), SamplingParams(max_tokens=100, seed=i, ignore_eos=True)) for i in range(3)]
        alone = [_run(eng, [j])[0][0] for j in jobs]
        together = [o[0] for o in _run(eng, jobs)]
        for (p, _), a, b in zip(jobs, alone, together):
            assert a.token_ids == b.token_ids
            ref, _ = _teacher_forced(tiny[0], p, b.token_ids)
            assert torch.allclose(torch.tensor(b.logprobs), ref, atol=1e-4)
    finally:
        eng.close()


def test_bad_prompts_are_value_errors(engine, tiny):
    _, tok = tiny
    for prompt, match in [([1, 2, 261], "Token id 261 is out of vocabulary"), ([-1, 5], "Token id -1"),
                          ([], "prompt is empty"), ([5] * 127, "maximum context length is 128")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            _run(engine, [(prompt, SamplingParams(max_tokens=4))])
    assert engine.healthy
    assert len(_run(engine, [([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))])[0][0].token_ids) == 3


def test_a_failing_request_fails_alone(engine, tiny, monkeypatch):
    model, tok = tiny
    real = se.process_logits

    def flaky(logits, params, *a):  # a request with top_k=7 poisons any batch it is in
        if any(p.top_k == 7 for p in params):
            raise RuntimeError("poisoned")
        return real(logits, params, *a)

    monkeypatch.setattr(se, "process_logits", flaky)
    p = _prompt(tok, "survivor")
    good = SamplingParams(max_tokens=8, seed=1, ignore_eos=True)

    async def go():
        return await asyncio.gather(
            engine.generate(p, good), engine.generate(_prompt(tok, "bad"), SamplingParams(max_tokens=8, top_k=7)),
            return_exceptions=True,
        )  # fmt: skip

    ok, bad = asyncio.run(go())
    assert isinstance(bad, EngineError) and "poisoned" in str(bad)
    ref, _ = _teacher_forced(model, p, ok[0].token_ids)
    assert torch.allclose(torch.tensor(ok[0].logprobs), ref, atol=1e-4)
    assert engine.healthy and _run(engine, [(p, good)])[0][0].token_ids == ok[0].token_ids


def test_a_dead_loop_is_unhealthy_and_fails_fast(engine, tiny, monkeypatch):
    _, tok = tiny

    def boom():
        raise RuntimeError("bug in the loop")

    monkeypatch.setattr(engine, "_compact", boom)
    with pytest.raises(EngineError, match="loop died"):
        _run(engine, [(_prompt(tok, "x"), SamplingParams(max_tokens=4))])
    engine._thread.join(5)
    assert not engine.healthy
    with pytest.raises(EngineError, match="not running"):
        _run(engine, [(_prompt(tok, "y"), SamplingParams(max_tokens=4))])


async def _until(predicate, what: str, timeout: float = 30) -> None:
    """Yield to the loop until `predicate()` holds: the request has reached the engine's queue or a slot, however
    loaded the machine (a fixed sleep either misses it or lets a short request finish first)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"waited {timeout}s for {what}"
        await asyncio.sleep(0.001)


def test_abort_all_and_pause_keep(engine, tiny):
    _, tok = tiny

    async def go():
        task = asyncio.ensure_future(
            engine.generate(_prompt(tok, "long"), SamplingParams(max_tokens=100, ignore_eos=True))
        )
        await _until(lambda: engine._running, "the request to reach a slot")
        await asyncio.to_thread(engine.pause)
        assert engine.is_paused
        n = await asyncio.to_thread(engine.abort_all)
        engine.resume()
        with pytest.raises(EngineError, match="aborted"):
            await task
        return n

    assert asyncio.run(go()) == 1
    assert not engine.is_paused and engine.healthy


def test_pause_resume_and_close_from_different_threads(engine, tiny):
    """The server runs /pause, /resume and shutdown on whichever worker thread is free: nothing in the slot engine
    may be bound to the thread that paused (transformers' manager.pause() is, and its stop() then refuses)."""
    from concurrent.futures import ThreadPoolExecutor

    _, tok = tiny
    a, b = ThreadPoolExecutor(1), ThreadPoolExecutor(1)

    async def go():
        task = asyncio.ensure_future(engine.generate(_prompt(tok, "t"), SamplingParams(max_tokens=40, ignore_eos=True)))
        await _until(lambda: engine._running, "the request to reach a slot")
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(a, engine.pause)
        await loop.run_in_executor(b, engine.pause)  # idempotent, from the other thread
        assert engine.is_paused
        await loop.run_in_executor(b, engine.resume)
        assert not engine.is_paused
        assert len((await task)[0].token_ids) == 40
        await loop.run_in_executor(b, engine.pause)  # paused at shutdown, closed from the thread that did not pause
        waiting = asyncio.ensure_future(engine.generate(_prompt(tok, "w"), SamplingParams(max_tokens=4)))
        await _until(lambda: engine._waiting, "the request to be queued behind the pause")
        await loop.run_in_executor(a, engine.close)
        with pytest.raises(EngineError, match="aborted"):  # a queued request fails instead of hanging
            await asyncio.wait_for(waiting, 10)

    try:
        asyncio.run(go())
        assert not engine._thread.is_alive() and not engine.healthy
    finally:
        a.shutdown(), b.shutdown()


def test_same_interface_as_the_continuous_batching_engine():
    public = {n for n in dir(CPUEngine) if not n.startswith("_")} - {"healthy"}
    missing = {n for n in public if not hasattr(se.SlotEngine, n)}
    assert not missing, missing
