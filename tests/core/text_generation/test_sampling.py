"""Sampling: the filters on hand-made logits, and the frequencies of many draws against the
filtered softmax computed here from its definition.

Statistical test: N independent draws of one step (one batch of N identical rows); each token's
count is Binomial(N, p_i). The test asserts |count_i / N - p_i| <= 5 sqrt(p_i (1 - p_i) / N) for
every kept token (5 standard deviations: a false alarm has probability below 1e-5 over the whole
vocabulary) and a count of exactly 0 for every token the filters drop.
"""
import math

import pytest
import torch

from megatron.core.text_generation.sampling import (GREEDY_SLICES, SamplingError, SamplingParams, filtered_logits,
                                                    greedy_tokens, next_tokens, sampling_probabilities)

DRAWS = 40_000


def expected_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> list[float]:
    """softmax(z / T) restricted to the top-k tokens, then to the smallest probability-sorted prefix
    whose mass exceeds top_p, renormalized: written out token by token."""
    scaled = [value / temperature for value in logits.tolist()]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    kept = order[:top_k] if top_k else order
    weights = {i: math.exp(scaled[i] - scaled[order[0]]) for i in kept}
    if top_p:
        total, mass, prefix = sum(weights.values()), 0.0, []
        for i in kept:
            if mass > top_p:
                break
            prefix.append(i)
            mass += weights[i] / total
        weights = {i: weights[i] for i in prefix}
    total = sum(weights.values())
    return [weights.get(i, 0.0) / total for i in range(len(scaled))]


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 0.0), (0.7, 5, 0.0), (1.3, 0, 0.8), (1.0, 6, 0.6)])
def test_draw_frequencies_match_the_filtered_softmax(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.9, 0.5, 0.3, 0.0, -0.5, -1.0, -2.0, 0.7])
    expected = expected_distribution(logits, temperature, top_k, top_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    torch.testing.assert_close(sampling_probabilities(logits[None], params)[0], torch.tensor(expected),
                               rtol=1e-5, atol=1e-7)
    generator = torch.Generator().manual_seed(11)
    draws = next_tokens(logits.expand(DRAWS, -1), params, vocab_size=len(logits), generator=generator)
    counts = torch.bincount(draws, minlength=len(logits)).tolist()
    for token, (count, p) in enumerate(zip(counts, expected)):
        if p == 0.0:
            assert count == 0, f"token {token} is filtered out but was drawn {count} times"
        else:
            assert abs(count / DRAWS - p) <= 5 * math.sqrt(p * (1 - p) / DRAWS), (token, count / DRAWS, p)
    assert (0.0 in expected) == bool(top_k or top_p)  # the filtered cases do drop tokens


def test_filters_on_hand_made_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    top_2 = filtered_logits(logits, SamplingParams(top_k=2))
    assert torch.isinf(top_2).tolist() == [[True, False, False, True]]
    # probabilities 0.644, 0.237, 0.087, 0.032: p = 0.6 keeps the first (its mass exceeds 0.6) only,
    # p = 0.7 the first two
    assert torch.isfinite(filtered_logits(logits, SamplingParams(top_p=0.6))).tolist() == [[False, True, False, False]]
    assert torch.isfinite(filtered_logits(logits, SamplingParams(top_p=0.7))).tolist() == [[False, True, True, False]]
    torch.testing.assert_close(filtered_logits(logits, SamplingParams(temperature=2.0)), (logits - 3.0) / 2)


@pytest.mark.parametrize("temperature", [1e-300, 1e-30, 1e300])
def test_extreme_temperatures_draw_from_the_limit(temperature):
    """T -> 0 is the greedy choice (ties shared evenly), T -> inf the uniform draw; neither overflows."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0]]).expand(2000, -1)
    probabilities = sampling_probabilities(logits, SamplingParams(temperature=temperature))
    expected = [0.0, 0.5, 0.0, 0.5, 0.0] if temperature < 1 else [0.2] * 5
    torch.testing.assert_close(probabilities[0], torch.tensor(expected))
    draws = next_tokens(logits, SamplingParams(temperature=temperature), 5, torch.Generator().manual_seed(3))
    assert set(draws.tolist()) == {i for i, p in enumerate(expected) if p > 0}


def test_greedy_seed_and_vocabulary_padding():
    logits = torch.tensor([[0.1, 0.2, 5.0, 9.0], [3.0, 0.0, 0.0, 9.0]])
    assert next_tokens(logits, SamplingParams(greedy=True), vocab_size=3).tolist() == [2, 0]
    params = SamplingParams(temperature=5.0)
    first, again, other = (next_tokens(logits.repeat(50, 1), params, 3, torch.Generator().manual_seed(seed))
                           for seed in (1, 1, 2))
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert int(first.max()) < 3


@pytest.mark.parametrize("vocab", [GREEDY_SLICES * GREEDY_SLICES, GREEDY_SLICES * 1002, GREEDY_SLICES * 1002 - 3])
def test_greedy_tokens_are_the_first_maximum(vocab):
    """torch.argmax's answer, ties included: maxima repeated within a slice, across slices, and in
    the slice before the row's largest; a vocabulary that is no multiple of the slices too."""
    torch.manual_seed(4)
    logits = torch.randn(5, vocab).to(torch.bfloat16)
    width = vocab // GREEDY_SLICES
    logits[1, [3 * width + 7, 3 * width + 9, 90 * width]] = 50.0  # the first occurrence's slice holds two
    logits[2, [width - 1, width]] = 50.0  # the last of one slice and the first of the next
    logits[3] = 1.0  # all equal: token 0
    logits[4, [vocab - 1]] = 50.0
    assert torch.equal(greedy_tokens(logits), torch.argmax(logits, dim=-1))
    assert greedy_tokens(logits)[:4].tolist() == [int(torch.argmax(logits[0])), 3 * width + 7, width - 1, 0]


@pytest.mark.parametrize("flags, message", [(dict(temperature=0.0), "--temperature 0.0"),
                                            (dict(top_k=-1), "--top_k -1"), (dict(top_p=1.5), "--top_p 1.5")])
def test_bad_parameters_are_named(flags, message):
    with pytest.raises(SamplingError, match=message):
        SamplingParams(**flags)
