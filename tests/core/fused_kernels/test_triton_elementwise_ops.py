"""The Triton SwiGLU and rotary embedding against their references on CUDA: fp16, bf16 and fp32, several
shapes (strided query/key views of the query_key_value output, grouped queries, partial rotary),
forward and backward.

The ``references`` fixture makes the references raise inside the public ops, so each public call in
these tests provably takes the Triton path; comparisons use the saved originals.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core import fused_kernels
from megatron.core.fused_kernels import elementwise_ops, selection
from megatron.core.models.gpt.positional import Llama3RopeScaling, rotary_inverse_frequencies
from tests.core.fused_kernels.kernel_test_utils import forbid_references

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
HALF_AND_FULL = [torch.float16, torch.bfloat16, torch.float32]
DTYPE_IDS = ["fp16", "bf16", "fp32"]
_REFERENCE_NAMES = ["swiglu_reference", "rotary_embedding_reference"]


@pytest.fixture
def references(monkeypatch):
    yield forbid_references(monkeypatch, elementwise_ops, _REFERENCE_NAMES)
    fused_kernels.set_fused_kernels_enabled(None)


def _assert_matches(fast, ref, ulps):
    """|fast - ref| within ``ulps`` epsilons of the dtype plus a few fp32 epsilons, relative to each value
    and to max |ref|."""
    assert fast.dtype == ref.dtype and fast.shape == ref.shape
    assert torch.isfinite(fast).all()
    tolerance = ulps * torch.finfo(ref.dtype).eps + 4 * torch.finfo(torch.float32).eps
    scale = ref.double().abs().max().item()
    torch.testing.assert_close(fast.double(), ref.double(), rtol=tolerance, atol=tolerance * scale)


def _leaf(tensor):
    return tensor.detach().clone().requires_grad_(True)


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(16, 4, 2 * 4096), (7, 3, 2 * 1000), (1, 2 * 33), (5, 2 * 8192)])
def test_swiglu_matches_reference_and_truth(references, dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, device=DEVICE) * 3
    grad = torch.randn(*shape[:-1], shape[-1] // 2, dtype=dtype, device=DEVICE)
    fast_x, ref_x = _leaf(x), _leaf(x)
    fast, ref = fused_kernels.swiglu(fast_x), references.swiglu_reference(ref_x)
    fast.backward(grad)
    ref.backward(grad)
    _assert_matches(fast, ref.detach(), ulps=3)  # the reference rounds silu(g) before the product
    _assert_matches(fast_x.grad, ref_x.grad, ulps=4)
    a, g = x.double().chunk(2, dim=-1)
    s = torch.sigmoid(g)
    _assert_matches(fast, (a * g * s).to(dtype), ulps=1)  # one rounding of the fp32 math
    grad64 = grad.double()
    truth_grad = torch.cat((grad64 * g * s, grad64 * a * s * (1 + g * (1 - s))), dim=-1)
    _assert_matches(fast_x.grad, truth_grad.to(dtype), ulps=1)


def test_swiglu_non_contiguous_input_and_gradient(references):
    torch.manual_seed(1)
    x = torch.randn(2 * 48, 20, device=DEVICE).t()  # [20, 96], strides (1, 20)
    grad = torch.randn(48, 20, device=DEVICE).t()
    fast_x, ref_x = _leaf(x), _leaf(x)
    fast, ref = fused_kernels.swiglu(fast_x), references.swiglu_reference(ref_x)
    fast.backward(grad)
    ref.backward(grad)
    _assert_matches(fast, ref.detach(), ulps=3)
    _assert_matches(fast_x.grad, ref_x.grad, ulps=4)


ROTARY_CASES = [  # s, b, groups, queries per group, hn, rotated d, Llama 3 scaling
    (37, 3, 4, 1, 64, 64, False),  # multi-head: query and key are strided views of the QKV output
    (64, 2, 2, 4, 64, 64, True),  # grouped queries (nk < nq): query a copy, key a view
    (33, 2, 2, 2, 80, 80, False),  # hn not a power of two
    (16, 2, 3, 1, 128, 32, False),  # partial rotary: 32 of 128 channels rotated
]


def _positions(kind, batch, seq):
    """Integer positions [b, s] (documents restarting at random points), large ones, or one shared row [1, s]."""
    if kind == "reset":
        starts = torch.rand(batch, seq, device=DEVICE) < 0.1
        index = torch.arange(seq, device=DEVICE).expand(batch, seq)
        last_start = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
        return index - last_start
    if kind == "large":
        return torch.randint(0, 32768, (batch, seq), device=DEVICE)
    return torch.arange(seq, device=DEVICE)[None, :]


def _incoming_gradient(shape, dtype, batch_first):
    """A gradient for an output of ``shape`` that is not contiguous ([s, b, heads, hn] memory, permuted)."""
    if not batch_first:
        return torch.randn(shape, dtype=dtype, device=DEVICE)
    batch, heads, seq, head_dim = shape
    return torch.randn(seq, batch, heads, head_dim, dtype=dtype, device=DEVICE).permute(1, 2, 0, 3)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("positions", ["reset", "large", "shared"])
@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", ROTARY_CASES, ids=["mha_views", "gqa", "hn80", "partial"])
def test_rotary_embedding_matches_reference(references, case, dtype, positions, batch_first):
    seq, batch, groups, queries, head_dim, dim, scaled = case
    torch.manual_seed(2)
    mixed = torch.randn(seq, batch, groups * (queries + 2) * head_dim, dtype=dtype, device=DEVICE)
    query, key, _ = fused_kernels.split_query_key_value(mixed, None, head_dim, queries)
    position_ids = _positions(positions, batch, seq)
    inv_freq = rotary_inverse_frequencies(dim, scaling=Llama3RopeScaling(original_max_position_embeddings=64)
                                          if scaled else None, device=DEVICE)
    fast_q, fast_k, ref_q, ref_k = (_leaf(t) for t in (query, key, query, key))
    fast = fused_kernels.rotary_embedding(fast_q, fast_k, position_ids, inv_freq, batch_first=batch_first)
    ref = references.rotary_embedding_reference(ref_q, ref_k, position_ids, inv_freq, batch_first)
    grads = [_incoming_gradient(t.shape, dtype, batch_first) for t in ref]
    torch.autograd.backward(fast, grads)
    torch.autograd.backward(ref, grads)
    for fast_out, ref_out in zip(fast, ref):
        assert fast_out.is_contiguous()
        _assert_matches(fast_out, ref_out.detach(), ulps=2)  # cos and sin may differ in their last fp32 bit
    for fast_grad, ref_grad in ((fast_q.grad, ref_q.grad), (fast_k.grad, ref_k.grad)):
        assert fast_grad.is_contiguous()
        _assert_matches(fast_grad, ref_grad, ulps=2)


def test_rotary_embedding_only_query_used(references):
    """Backward when the key's output gets no gradient (autograd hands the kernel zeros)."""
    torch.manual_seed(3)
    query, key = torch.randn(8, 2, 4, 32, device=DEVICE), torch.randn(8, 2, 2, 32, device=DEVICE)
    position_ids, inv_freq = _positions("reset", 2, 8), rotary_inverse_frequencies(32, device=DEVICE)
    fast_q, fast_k, ref_q, ref_k = (_leaf(t) for t in (query, key, query, key))
    fused_kernels.rotary_embedding(fast_q, fast_k, position_ids, inv_freq)[0].sum().backward()
    references.rotary_embedding_reference(ref_q, ref_k, position_ids, inv_freq)[0].sum().backward()
    _assert_matches(fast_q.grad, ref_q.grad, ulps=2)
    assert fast_k.grad is None or not fast_k.grad.any()


def test_attention_inputs_through_split_rotary_and_sdpa(references):
    """The attention's path (split, rotary, sdpa, grouped queries) gives the references' gradient of mixed."""
    torch.manual_seed(4)
    seq, batch, groups, queries, head_dim = 128, 2, 2, 4, 64
    mixed = torch.randn(seq, batch, groups * (queries + 2) * head_dim, dtype=torch.bfloat16, device=DEVICE)
    position_ids, inv_freq = _positions("reset", batch, seq), rotary_inverse_frequencies(head_dim, device=DEVICE)

    def attention(mixed_leaf, rotary):
        query, key, value = fused_kernels.split_query_key_value(mixed_leaf, None, head_dim, queries)
        query, key = rotary(query, key, position_ids, inv_freq, True)
        value = value.permute(1, 2, 0, 3)
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True,
                                              scale=1.0 / math.sqrt(head_dim))

    fast_mixed, ref_mixed = _leaf(mixed), _leaf(mixed)
    fast = attention(fast_mixed, fused_kernels.rotary_embedding)
    ref = attention(ref_mixed, references.rotary_embedding_reference)
    grad = torch.randn_like(ref)
    fast.backward(grad)
    ref.backward(grad)
    _assert_matches(fast, ref.detach(), ulps=2)
    _assert_matches(fast_mixed.grad, ref_mixed.grad, ulps=2)


def test_rotary_embedding_falls_back_on_fp64_frequencies(monkeypatch):
    monkeypatch.setattr(selection, "_enabled_override", True)
    calls = []
    original = elementwise_ops.rotary_embedding_reference
    monkeypatch.setattr(elementwise_ops, "rotary_embedding_reference", lambda *args: calls.append(1) or original(*args))
    query, key = torch.randn(4, 1, 2, 16, device=DEVICE), torch.randn(4, 1, 2, 16, device=DEVICE)
    position_ids = _positions("shared", 1, 4)
    inv_freq = rotary_inverse_frequencies(16, device=DEVICE).double()
    fused_kernels.rotary_embedding(query, key, position_ids, inv_freq)
    assert calls == [1]
