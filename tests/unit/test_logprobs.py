"""chunked_logprobs vs the naive full_logprobs: values, gradients, temperature, entropy, and saved-tensor sizes."""

from __future__ import annotations

import math

import pytest
import torch

from verifiers_rl.loss.logprobs import chunked_logprobs, full_logprobs

N, H, V = 13, 8, 50


def _inputs(seed=0, bias=False, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=gen).to(dtype).requires_grad_()
    b = torch.randn(V, generator=gen).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, V, (N,), generator=gen)
    return hidden, weight, b, targets


def _values_and_grads(fn, hidden, weight, bias, targets, **kw):
    logp, ent = fn(hidden, weight, targets, bias=bias, **kw)
    # A non-uniform upstream gradient so a mix-up between rows would show.
    (logp * torch.linspace(-1.0, 2.0, logp.numel())).sum().backward()
    params = [hidden, weight] + ([bias] if bias is not None else [])
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return logp.detach(), ent, grads


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 13, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_naive_values_and_grads(chunk_size, bias):
    hidden, weight, b, targets = _inputs(bias=bias)
    ref_lp, ref_ent, ref_grads = _values_and_grads(full_logprobs, hidden, weight, b, targets)
    lp, ent, grads = _values_and_grads(chunked_logprobs, hidden, weight, b, targets, chunk_size=chunk_size)
    assert lp.dtype == torch.float32 and lp.shape == (N,)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    assert not ent.requires_grad
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, atol=1e-5, rtol=1e-5)


def test_hand_computed_uniform_and_entropy():
    # zero weights -> uniform distribution: log p = -log V, entropy = log V
    hidden = torch.randn(3, H)
    weight = torch.zeros(V, H, requires_grad=True)
    lp, ent = chunked_logprobs(hidden, weight, torch.tensor([0, 7, 49]), chunk_size=2)
    torch.testing.assert_close(lp, torch.full((3,), -math.log(V)))
    torch.testing.assert_close(ent, torch.full((3,), math.log(V)))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature(temperature):
    hidden, weight, b, targets = _inputs(seed=1, bias=True)
    lp, ent = chunked_logprobs(hidden, weight, targets, bias=b, temperature=temperature, chunk_size=4)
    logits = (hidden @ weight.T + b) / temperature
    expected = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(lp, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, -(probs * probs.log()).sum(-1), atol=1e-5, rtol=1e-5)
    ref = _values_and_grads(full_logprobs, hidden, weight, b, targets, temperature=temperature)
    got = _values_and_grads(chunked_logprobs, hidden, weight, b, targets, temperature=temperature, chunk_size=4)
    for g, rg in zip(got[2], ref[2]):
        torch.testing.assert_close(g, rg, atol=1e-5, rtol=1e-5)


def test_low_precision_inputs_give_float32_and_grads_in_input_dtype():
    hidden, weight, _, targets = _inputs(dtype=torch.bfloat16)
    lp, _ = chunked_logprobs(hidden, weight, targets, chunk_size=4)
    ref, _ = full_logprobs(hidden, weight, targets)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref)
    lp.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16


def test_float32_hidden_states_meet_a_bf16_head_in_its_dtype():
    """A bf16 model under bf16=True: accelerate hands the forward's outputs back as float32, the head stays bf16.
    The head runs in its own dtype (as under autocast) and the gradient reaches the hidden states as float32."""
    hidden, weight, _, targets = _inputs(dtype=torch.bfloat16)
    wide = hidden.detach().float().requires_grad_()
    for fn in (chunked_logprobs, full_logprobs):
        lp, ent = fn(wide, weight, targets, chunk_size=4)
        ref, ref_ent = fn(hidden, weight, targets, chunk_size=4)
        torch.testing.assert_close(lp, ref)
        torch.testing.assert_close(ent, ref_ent)
    lp.sum().backward()
    assert wide.grad.dtype == torch.float32 and torch.isfinite(wide.grad).all() and wide.grad.abs().sum() > 0


def test_without_entropy_and_empty_input():
    hidden, weight, _, targets = _inputs()
    lp, ent = chunked_logprobs(hidden, weight, targets, with_entropy=False)
    assert ent is None and lp.shape == (N,)
    lp0, ent0 = chunked_logprobs(hidden[:0], weight, targets[:0])
    assert lp0.shape == (0,) and ent0.shape == (0,)
    lp0.sum().backward()  # an empty step must still be backward-able
    assert weight.grad is not None and weight.grad.abs().sum() == 0


def _max_saved_numel(fn, hidden, weight, targets, **kw):
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = fn(hidden, weight, targets, **kw)
    logp.sum().backward()
    return max(sizes, default=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_no_full_logits_saved_for_backward(temperature):
    n, v = 64, 200
    hidden = torch.randn(n, H, requires_grad=True)
    weight = torch.randn(v, H, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    # the hook does see the naive version's [N, V] logits, so its silence below means something
    assert _max_saved_numel(full_logprobs, hidden, weight, targets, temperature=temperature) >= n * v
    saved = _max_saved_numel(chunked_logprobs, hidden, weight, targets, temperature=temperature, chunk_size=16)
    assert saved < 16 * v
    assert saved <= max(n * H, v * H)


def test_saved_tensors_are_the_inputs_only():
    # What backward keeps: hidden, weight and targets themselves, never a [chunk, V] logits block.
    n, v = 64, 200
    hidden = torch.randn(n, H, requires_grad=True)
    weight = torch.randn(v, H, requires_grad=True)
    targets = torch.randint(0, v, (n,))
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        chunked_logprobs(hidden, weight, targets, chunk_size=16)
    assert sorted(sizes) == sorted([n * H, v * H, n])


def test_bad_arguments():
    hidden, weight, _, targets = _inputs()
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_logprobs(hidden, weight, targets, chunk_size=0)
    with pytest.raises(ValueError, match="targets"):
        chunked_logprobs(hidden, weight, targets[:-1])
    with pytest.raises(ValueError, match="hidden"):
        full_logprobs(hidden, weight[:, :-1], targets)
