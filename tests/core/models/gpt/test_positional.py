"""Rotary embeddings and ALiBi against the formulas written out independently, and the learned table."""
import math

import pytest
import torch

from megatron.core.fused_kernels import rotary_embedding
from megatron.core.models.gpt.positional import (LearnedPositionEmbedding, Llama3RopeScaling, alibi_bias,
                                                 alibi_slopes, rotary_inverse_frequencies)


def rotate(x, positions, dim, base=10000.0):
    """The model's rotary embedding of x [s, b, heads, hn] at positions [b, s], as [s, b, heads, hn]."""
    rotated, _ = rotary_embedding(x, x, positions, rotary_inverse_frequencies(dim, base), batch_first=False)
    return rotated


def rotary_by_pairs(x, positions, base=10000.0):
    """Direct formula in float64: channel i and i + d/2 rotate by angle p * base^(-2i/d).

    x: [s, b, heads, d]; positions: [b, s].
    """
    s, b, heads, d = x.shape
    out = torch.empty_like(x, dtype=torch.float64)
    for t in range(s):
        for n in range(b):
            p = float(positions[n, t])
            for i in range(d // 2):
                angle = p * base ** (-2.0 * i / d)
                c, sn = math.cos(angle), math.sin(angle)
                first, second = x[t, n, :, i].double(), x[t, n, :, i + d // 2].double()
                out[t, n, :, i] = first * c - second * sn
                out[t, n, :, i + d // 2] = second * c + first * sn
    return out


def test_rotary_matches_pairwise_rotation():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 2, 3, 8, generator=generator)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 0, 1, 2, 30]])  # second row: reset positions
    got = rotate(x, positions, 8)
    torch.testing.assert_close(got.double(), rotary_by_pairs(x, positions), rtol=1e-5, atol=1e-6)


def test_rotary_scores_depend_only_on_relative_position():
    generator = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 1, 16, generator=generator), torch.randn(1, 1, 1, 16, generator=generator)

    def score(p_q, p_k):
        return float((rotate(q, torch.tensor([[p_q]]), 16) * rotate(k, torch.tensor([[p_k]]), 16)).sum())

    assert score(10, 3) == pytest.approx(score(107, 100), abs=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), abs=1e-3)


def test_rotary_is_bf16_safe_at_long_positions():
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(4, 1, 2, 64, generator=generator).to(torch.bfloat16)
    positions = torch.tensor([[4093, 4094, 4095, 4096]])
    got = rotate(x, positions, 64)
    assert got.dtype == torch.bfloat16
    expected = rotary_by_pairs(x.double(), positions)
    # only the final rounding to bf16 remains: well under 2^-8 relative per element
    assert float(((got.double() - expected).abs() / expected.abs().clamp_min(1e-2)).max()) < 2 ** -7
    # what bf16-safety avoids: angles p * theta formed in bf16 are off by whole radians at p ~ 4096
    inv_freq = (1.0 / 10000 ** (torch.arange(0, 64, 2) / 64)).to(torch.bfloat16)
    angles = positions.t().to(torch.bfloat16)[..., None] * inv_freq
    angles = torch.cat((angles, angles), -1)[:, :, None, :]
    naive = x * angles.cos() + torch.cat((-x[..., 32:], x[..., :32]), -1) * angles.sin()
    assert (naive.double() - expected).norm() > 10 * (got.double() - expected).norm()


@pytest.mark.parametrize("heads, expected", [
    (4, [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]),
    (8, [2 ** -i for i in range(1, 9)]),
    # 12 heads: the 8-head slopes, then every other slope of the 16-head sequence 2^(-k/2)
    (12, [2 ** -i for i in range(1, 9)] + [2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5]),
    (1, [2 ** -8]),
])
def test_alibi_slopes(heads, expected):
    torch.testing.assert_close(alibi_slopes(heads), torch.tensor(expected, dtype=torch.float32))


def test_alibi_bias_and_equivalence_with_megatron_deepspeeds_form():
    slopes = alibi_slopes(4)
    bias = alibi_bias(slopes, 6)
    assert bias.shape == (4, 6, 6)
    for j in range(4):
        for q in range(6):
            for k in range(6):
                assert float(bias[j, q, k]) == pytest.approx(float(slopes[j]) * (k - q))
    # Megatron-DeepSpeed adds m * k: softmax over the causal keys is the same (a constant per query row)
    scores = torch.randn(4, 6, 6, generator=torch.Generator().manual_seed(3))
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    key_position_form = slopes[:, None, None] * torch.arange(6.0)[None, None, :]
    ours = torch.softmax((scores + bias).masked_fill(causal, float("-inf")), -1)
    theirs = torch.softmax((scores + key_position_form).masked_fill(causal, float("-inf")), -1)
    torch.testing.assert_close(ours, theirs)


def test_learned_position_embedding_lookup_and_length_check():
    table = LearnedPositionEmbedding(8, 4, torch.float32)
    torch.nn.init.normal_(table.weight)
    positions = torch.tensor([[0, 3, 7], [1, 1, 2]])
    torch.testing.assert_close(table(positions), table.weight[positions])
    with pytest.raises(ValueError, match="--max-position-embeddings"):
        table(torch.zeros(1, 9, dtype=torch.long))


def test_llama3_rope_scaling_matches_transformers():
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, rope_theta=500000.0,
                                      max_position_embeddings=131072,
                                      rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                                        high_freq_factor=4.0, original_max_position_embeddings=8192))
    expected, attention_scaling = rope_utils.ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = rotary_inverse_frequencies(128, 500000.0, Llama3RopeScaling(32.0, 1.0, 4.0, 8192))
    assert attention_scaling == 1.0
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)
    plain = rotary_inverse_frequencies(128, 500000.0)
    assert torch.equal(ours[:20], plain[:20])  # short wavelengths are kept
    torch.testing.assert_close(ours[-10:], plain[-10:] / 32.0)  # long ones are stretched by the factor


def test_partial_rotary_leaves_the_other_channels():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2, 3, 16, generator=generator)
    positions = torch.tensor([[0, 1, 2, 3, 4], [9, 8, 7, 6, 5]])
    got = rotate(x, positions, 8)
    assert torch.equal(got[..., 8:], x[..., 8:])
    torch.testing.assert_close(got[..., :8].double(), rotary_by_pairs(x[..., :8], positions), rtol=1e-5, atol=1e-6)
