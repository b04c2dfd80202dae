import pytest
import torch

from verifiers_rl.inference.cpu.sampling import (
    SamplingParams,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    process_logits,
    request_generator,
    sample,
    sample_inverse_cdf,
)


def test_params_validation_names_field():
    with pytest.raises(ValueError, match="top_p=1.5 must be in"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="n=0"):
        SamplingParams(n=0)


def test_default_params_leave_logits_untouched():
    logits = torch.randn(3, 11)
    assert torch.equal(process_logits(logits, [SamplingParams()] * 3), logits)


def test_temperature_only_equals_scaled_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(2, 50)
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3)]
    processed = process_logits(logits, params)
    tokens, lp = sample(processed, [False, False], [None, None])
    expected = torch.stack([torch.log_softmax(logits[0] / 0.7, -1), torch.log_softmax(logits[1] / 1.3, -1)])
    assert torch.allclose(lp, expected.gather(1, tokens[:, None]).squeeze(1), atol=1e-6)


def test_top_k_keeps_k_best():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(out).tolist() == [[False, True, False, True, False]]


def test_top_p_keeps_smallest_prefix_reaching_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = apply_top_k_top_p(probs.log(), torch.tensor([-1]), torch.tensor([0.7]))
    # 0.5 < 0.7, 0.5+0.3 >= 0.7 -> keep first two
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    out = apply_top_k_top_p(probs.log(), torch.tensor([-1]), torch.tensor([0.5]))
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]


def test_min_p_masks_relative_to_max():
    probs = torch.tensor([[0.6, 0.3, 0.07, 0.03]])
    out = apply_min_p(probs.log(), torch.tensor([0.1]))
    assert torch.isfinite(out).tolist() == [[True, True, True, False]]


def test_penalties_follow_vllm_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    out = apply_penalties(
        logits,
        prompt_ids=[[0]],
        output_ids=[[1, 1, 2]],
        repetition=torch.tensor([2.0]),
        presence=torch.tensor([0.5]),
        frequency=torch.tensor([0.25]),
    )
    # token0: prompt only -> repetition: 2/2 = 1
    # token1: output x2 -> -2*2 - 0.25*2 - 0.5 = -5
    # token2: output x1 -> 1/2 - 0.25 - 0.5 = -0.25 ; token3 untouched
    assert torch.allclose(out, torch.tensor([[1.0, -5.0, -0.25, 0.5]]))


def test_seeded_sampling_is_independent_of_batch_neighbours():
    torch.manual_seed(1)
    row = torch.randn(1, 200)
    alone, _ = sample(row, [False], [request_generator(42)])
    crowd = torch.cat([torch.randn(3, 200), row])
    with_others, _ = sample(crowd, [False] * 4, [None, request_generator(7), None, request_generator(42)])
    assert alone.item() == with_others[3].item()


def test_sampling_matches_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    g = request_generator(3)
    counts = torch.zeros(3)
    for _ in range(3000):
        t, _ = sample(probs.log()[None], [False], [g])
        counts[t] += 1
    assert torch.allclose(counts / 3000, probs, atol=0.03)


def test_greedy_rows_take_argmax_with_finite_logprob():
    logits = torch.tensor([[0.1, 3.0, 0.2]])
    p = SamplingParams(temperature=0.0)
    tokens, lp = sample(process_logits(logits, [p]), [p.greedy], [None])
    assert tokens.item() == 1
    assert torch.isclose(lp, torch.log_softmax(logits, -1)[0, 1])


def test_n_choices_get_distinct_streams():
    a, b = request_generator(5, 0), request_generator(5, 1)
    assert not torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


def test_inverse_cdf_sampling_matches_distribution_and_masks():
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    logits = probs.log()[None].repeat(4000, 1)
    logits[:, 2] = float("-inf")  # a masked token (top-k/top-p/min-p) is never drawn
    g = request_generator(5)
    tokens, lp = sample_inverse_cdf(logits, [False] * 4000, torch.rand(4000, generator=g))
    counts = torch.bincount(tokens, minlength=4).float() / 4000
    expected = torch.tensor([0.6, 0.25, 0.0, 0.05]) / 0.9
    assert counts[2] == 0 and torch.allclose(counts, expected, atol=0.03)
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1))
    # u at the very top of [0, 1) stays on a real token
    t, _ = sample_inverse_cdf(logits[:1], [False], torch.tensor([1.0 - 1e-12]))
    assert t.item() == 3


def test_inverse_cdf_rows_are_independent_and_greedy_rows_take_argmax():
    torch.manual_seed(2)
    rows = torch.randn(3, 50)
    u = torch.tensor([0.3, 0.7, 0.9])
    together, _ = sample_inverse_cdf(rows, [False, True, False], u)
    alone, _ = sample_inverse_cdf(rows[2:], [False], u[2:])
    assert together[2] == alone[0] and together[1] == rows[1].argmax()
