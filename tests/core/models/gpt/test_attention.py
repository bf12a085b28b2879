"""ParallelSelfAttention (TP = 1) against attention written out head by head in float64."""
import math

import pytest
import torch

from megatron.core.models.gpt.attention import ParallelSelfAttention
from megatron.core.models.gpt.masks import get_ltor_masks_and_position_ids
from megatron.core.parallel_state import single_rank_groups
from megatron.core.tensor_parallel.random import model_parallel_seed
from tests.core.models.gpt.gpt_test_utils import randomize_parameters, tiny_config
from tests.core.models.gpt.test_positional import rotary_by_pairs

LAYER_NUMBER = 3  # > 1 so that query-key layer scaling changes the materialized path's intermediates


@torch.no_grad()
def reference_attention(module, x, position_ids, attention_mask, kind):
    """o = concat_j softmax(q_j k_j^T / sqrt(hn) + B_j, causal and mask) v_j, then the output projection.

    The fused QKV weight holds, for head j, rows [3 hn j, 3 hn j + hn) = W_q, then W_k, then W_v.
    """
    s, b, _ = x.shape
    n, hn = module.heads_per_partition, module.head_dim
    weight, bias = module.query_key_value.weight.double(), module.query_key_value.bias.double()
    x = x.double()
    slopes = [2.0 ** (-8.0 * (j + 1) / n) for j in range(n)]  # n is a power of two here
    forbidden = torch.ones(s, s, dtype=torch.bool).triu(1).expand(b, s, s)
    if attention_mask is not None:
        forbidden = forbidden | attention_mask[:, 0]
    heads = []
    for j in range(n):
        rows = [slice(3 * hn * j + i * hn, 3 * hn * j + (i + 1) * hn) for i in range(3)]
        q, k, v = (x @ weight[r].t() + bias[r] for r in rows)  # [s, b, hn]
        if kind == "rotary":
            q = rotary_by_pairs(q[:, :, None], position_ids)[:, :, 0]
            k = rotary_by_pairs(k[:, :, None], position_ids)[:, :, 0]
        scores = torch.einsum("qbd,kbd->bqk", q, k) / math.sqrt(hn)
        if kind == "alibi":
            distance = torch.arange(s)[None, :] - torch.arange(s)[:, None]
            scores = scores + slopes[j] * distance
        probs = torch.softmax(scores.masked_fill(forbidden, float("-inf")), dim=-1)
        heads.append(torch.einsum("bqk,kbd->qbd", probs, v))
    context = torch.cat(heads, dim=-1)  # [s, b, n hn]
    return context @ module.dense.weight.double().t() + module.dense.bias.double()


def build(kind, impl, **overrides):
    config = tiny_config(position_embedding_type=kind, attention_impl=impl, **overrides)
    module = ParallelSelfAttention(config, LAYER_NUMBER, single_rank_groups())
    randomize_parameters(module, seed=11, scale=0.3)
    return module


TOKENS = torch.tensor([[3, 9, 1, 0, 4, 7, 0, 2, 5, 6, 8, 0, 9, 9, 1, 3],
                       [1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5, 6, 7]])


@pytest.mark.parametrize("impl", ["sdpa", "materialized"])
@pytest.mark.parametrize("kind", ["absolute", "rotary", "alibi"])
@pytest.mark.parametrize("reset", [False, True])
def test_attention_matches_reference(kind, impl, reset):
    module = build(kind, impl)
    masks = get_ltor_masks_and_position_ids(TOKENS, 0, reset_position_ids=reset, reset_attention_mask=reset)
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(5))
    output, bias = module(x, masks.position_ids, masks.attention_mask)
    expected = reference_attention(module, x, masks.position_ids, masks.attention_mask, kind)
    torch.testing.assert_close((output + bias).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["absolute", "alibi"])
def test_low_precision_paths_agree(kind):
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(6))
    position_ids = torch.arange(16).expand(2, 16)
    outputs = []
    for impl in ("sdpa", "materialized"):
        module = build(kind, impl, params_dtype=torch.bfloat16)
        output, bias = module(x.to(torch.bfloat16), position_ids)
        outputs.append((output + bias).detach().double())
    reference = reference_attention(build(kind, "sdpa"), x.to(torch.bfloat16).float(), position_ids, None, kind)
    for output in outputs:
        assert float((output - reference).norm() / reference.norm()) < 2e-2


def test_query_key_layer_scaling_keeps_fp16_scores_finite():
    """q.k of ~1e5 overflows fp16; scaled by 1 / (sqrt(hn) layer_number) inside the GEMM it does not."""
    module = build("absolute", "materialized", params_dtype=torch.float16)
    query = torch.full((1, 1, 4, 8), 120.0, dtype=torch.float16)
    value = torch.randn(1, 1, 4, 8).to(torch.float16)
    context = module._materialized(query, query, value, None, None)
    assert torch.isfinite(context).all()
    # all scores equal, so causal softmax averages the visible values
    expected = torch.cumsum(value.float(), dim=2) / torch.arange(1, 5).view(1, 1, 4, 1)
    torch.testing.assert_close(context.float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("impl", ["sdpa", "materialized"])
def test_attention_dropout_runs_on_the_model_parallel_stream(impl):
    module = build("absolute", impl, attention_dropout=0.5)
    model_parallel_seed(123, tp_rank=0, pp_rank=0)
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(7))
    position_ids = torch.arange(16).expand(2, 16)
    module.eval()
    without_dropout = module(x, position_ids)[0]
    module.train()
    default_state = torch.get_rng_state()
    first = module(x, position_ids)[0]
    assert torch.equal(torch.get_rng_state(), default_state), "dropout must not draw from the default stream"
    second = module(x, position_ids)[0]
    assert not torch.allclose(first, without_dropout) and not torch.allclose(first, second)
