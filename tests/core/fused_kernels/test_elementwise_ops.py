"""SwiGLU and the rotary embedding (fused_kernels/elementwise_ops.py) on CPU: the entry points give the
model's math exactly (values and gradients), CPU never asks for a kernel, the kernels' constraints,
bad arguments."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core import fused_kernels
from megatron.core.fused_kernels import elementwise_ops, selection
from megatron.core.fused_kernels.selection import FusedKernelArgumentError
from megatron.core.models.gpt.positional import Llama3RopeScaling, rotary_inverse_frequencies


@pytest.fixture
def no_kernel_requested(monkeypatch):
    requested = {}
    monkeypatch.setattr(selection, "_kernel_modules", requested)
    yield
    assert requested == {}


def _leaf(tensor):
    return tensor.detach().clone().requires_grad_(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_is_the_mlp_math_with_its_gradient(dtype, no_kernel_requested):
    torch.manual_seed(0)
    x = torch.randn(5, 2, 2 * 6, dtype=dtype)
    grad = torch.randn(5, 2, 6, dtype=dtype)
    ours, model = _leaf(x), _leaf(x)
    y = fused_kernels.swiglu(ours)
    linear, gate = model.chunk(2, dim=-1)
    expected = linear * F.silu(gate)
    assert y.shape == (5, 2, 6) and y.dtype == dtype and torch.equal(y, expected)
    y.backward(grad)
    expected.backward(grad)
    assert torch.equal(ours.grad, model.grad)


def _model_rotary(x, position_ids, inv_freq):
    """The rotary formula written out: pair (i, i + d/2) of x [s, b, heads, hn] turned by float32(p) * theta_i
    in fp32, the channels past d kept, cast back."""
    half = inv_freq.shape[0]
    angles = position_ids.t().to(torch.float32)[..., None] * inv_freq  # [s, b, d / 2]
    cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
    x32 = x.to(torch.float32)
    first, second = x32[..., :half], x32[..., half:2 * half]
    turned = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).to(x.dtype)
    return torch.cat((turned, x[..., 2 * half:]), dim=-1)


ROTARY_CASES = [  # s, b, groups, queries per group, hn, rotated d, scaling, positions [1, s]
    (7, 2, 3, 1, 16, 16, None, False),  # multi-head, views of the QKV output
    (5, 3, 2, 4, 16, 16, Llama3RopeScaling(original_max_position_embeddings=32), False),  # grouped query
    (6, 2, 2, 2, 12, 4, None, True),  # partial rotary, broadcast positions
]


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("case", ROTARY_CASES, ids=["mha", "gqa_llama3", "partial"])
def test_rotary_embedding_is_the_model_math_with_its_gradient(case, batch_first, no_kernel_requested):
    seq, batch, groups, queries, head_dim, dim, scaling, shared_positions = case
    torch.manual_seed(1)
    mixed = torch.randn(seq, batch, groups * (queries + 2) * head_dim, dtype=torch.bfloat16)
    query, key, _ = fused_kernels.split_query_key_value(mixed, None, head_dim, queries)
    position_ids = torch.randint(0, 4096, (1 if shared_positions else batch, seq))
    inv_freq = rotary_inverse_frequencies(dim, scaling=scaling)
    ours_q, ours_k, model_q, model_k = (_leaf(t) for t in (query, key, query, key))
    out_q, out_k = fused_kernels.rotary_embedding(ours_q, ours_k, position_ids, inv_freq, batch_first=batch_first)
    expected_q, expected_k = (_model_rotary(t, position_ids, inv_freq) for t in (model_q, model_k))
    if batch_first:
        expected_q, expected_k = expected_q.permute(1, 2, 0, 3), expected_k.permute(1, 2, 0, 3)
    assert out_q.shape == expected_q.shape and out_k.shape == expected_k.shape
    assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)
    grad_q, grad_k = torch.randn(out_q.shape, dtype=out_q.dtype), torch.randn(out_k.shape, dtype=out_k.dtype)
    torch.autograd.backward((out_q, out_k), (grad_q, grad_k))
    torch.autograd.backward((expected_q, expected_k), (grad_q, grad_k))
    assert torch.equal(ours_q.grad, model_q.grad) and torch.equal(ours_k.grad, model_k.grad)


def test_the_references_are_exported():
    assert fused_kernels.swiglu_reference is elementwise_ops.swiglu_reference
    assert fused_kernels.rotary_embedding_reference is elementwise_ops.rotary_embedding_reference


def test_swiglu_constraints():
    assert elementwise_ops.swiglu_constraint_violation(torch.zeros(2, 4, dtype=torch.bfloat16)) is None
    assert "dtype torch.float64" in elementwise_ops.swiglu_constraint_violation(torch.zeros(2, 4, dtype=torch.float64))
    assert "0 elements" in elementwise_ops.swiglu_constraint_violation(torch.zeros(0, 4))


def test_rotary_constraints():
    query, key = torch.zeros(2, 1, 2, 8, dtype=torch.bfloat16), torch.zeros(2, 1, 1, 8, dtype=torch.bfloat16)
    positions, inv_freq = torch.zeros(1, 2, dtype=torch.int64), torch.ones(4)
    violation = elementwise_ops.rotary_constraint_violation
    assert violation(query, key, positions, inv_freq) is None
    assert "inv_freq has dtype torch.float64" in violation(query, key, positions, inv_freq.double())
    assert "position_ids have dtype torch.float32" in violation(query, key, positions.float(), inv_freq)
    assert "key has dtype torch.float32" in violation(query, key.float(), positions, inv_freq)
    assert "query has dtype torch.float64" in violation(query.double(), key.double(), positions, inv_freq)
    assert "empty" in violation(query[:0], key[:0], positions[:, :0], inv_freq)
    huge = torch.zeros(1, dtype=torch.bfloat16).expand(2**16, 2**8, 2**4, 2**3)  # 2^31 elements, no memory
    assert "more than 2147483647 elements" in violation(huge, huge, positions, inv_freq)


def test_swiglu_refuses_an_odd_last_dim():
    with pytest.raises(FusedKernelArgumentError, match=r"swiglu: the last dim of x must be even .* \(3, 5\)"):
        fused_kernels.swiglu(torch.zeros(3, 5))


@pytest.mark.parametrize("shapes, message", [
    (((2, 1, 2, 8), (2, 1, 1, 8), (1, 2), (4,)), None),
    (((2, 2, 8), (2, 1, 1, 8), (1, 2), (4,)), r"query and key must be \[s, b, heads, hn\]"),
    (((2, 1, 2, 8), (3, 1, 1, 8), (1, 2), (4,)), r"key \(3, 1, 1, 8\) does not match query"),
    (((2, 1, 2, 8), (2, 1, 1, 6), (1, 2), (4,)), r"key \(2, 1, 1, 6\) does not match query"),
    (((2, 3, 2, 8), (2, 3, 1, 8), (2, 2), (4,)), r"position_ids .* \(b = 3, s = 2 .* got \(2, 2\)"),
    (((2, 1, 2, 8), (2, 1, 1, 8), (1, 3), (4,)), r"position_ids must be \[b, s\] or \[1, s\] \(b = 1, s = 2 .*\(1, 3\)"),
    (((2, 1, 2, 8), (2, 1, 1, 8), (1, 2), (5,)), r"inv_freq must be \[d / 2\] with 2 <= d <= hn = 8, got \(5,\)"),
    (((2, 1, 2, 8), (2, 1, 1, 8), (1, 2), (0,)), r"inv_freq must be \[d / 2\]"),
], ids=["fine", "query_rank", "key_seq", "key_head_dim", "positions_batch", "positions_seq", "inv_freq_long",
        "inv_freq_empty"])
def test_rotary_embedding_checks_its_arguments(shapes, message):
    query_shape, key_shape, positions_shape, inv_freq_shape = shapes
    arguments = (torch.zeros(query_shape), torch.zeros(key_shape), torch.zeros(positions_shape, dtype=torch.int64),
                 torch.ones(inv_freq_shape))
    if message is None:
        fused_kernels.rotary_embedding(*arguments)
        return
    with pytest.raises(FusedKernelArgumentError, match="rotary_embedding: " + message):
        fused_kernels.rotary_embedding(*arguments)
