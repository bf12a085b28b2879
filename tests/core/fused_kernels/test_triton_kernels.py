"""The Triton kernels against the references on CUDA: fp16, bf16 and fp32, several shapes, forward and backward.

The ``references`` fixture makes every reference raise inside the public ops, so each public call in
these tests provably takes the fast path; comparisons use the saved originals.
"""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from megatron.core import fused_kernels
from megatron.core.fused_kernels import decode_ops, reference, training_ops
from tests.core.fused_kernels.kernel_test_utils import forbid_references, forbidden

pytestmark = pytest.mark.gpu

HALF_AND_FULL = [torch.float16, torch.bfloat16, torch.float32]
DTYPE_IDS = ["fp16", "bf16", "fp32"]
_REFERENCE_NAMES = [
    "scale_mask_softmax_reference",
    "layer_norm_reference",
    "rms_norm_reference",
    "bias_gelu_reference",
    "bias_dropout_add_reference",
    "decode_attention_reference",
    "linear_reference",
    "layer_norm_linear_reference",
    "split_query_key_value_reference",
    "adamw_step_reference",
]


@pytest.fixture
def references(monkeypatch):
    yield forbid_references(monkeypatch, reference, _REFERENCE_NAMES)
    fused_kernels.set_fused_kernels_enabled(None)


def _assert_matches(fast, ref, ulps, reduced=1):
    """|fast - ref| within ``ulps`` epsilons of the dtype, plus fp32 rounding of a sum of ``reduced``
    terms (summed in another order), relative to each value and to max |ref|."""
    assert fast.dtype == ref.dtype and fast.shape == ref.shape
    assert torch.isfinite(fast).all()
    tolerance = ulps * torch.finfo(ref.dtype).eps + 4 * math.sqrt(reduced) * torch.finfo(torch.float32).eps
    scale = ref.double().abs().max().item()
    torch.testing.assert_close(fast.double(), ref.double(), rtol=tolerance, atol=tolerance * scale)


def _leaf(tensor):
    return tensor.detach().clone().requires_grad_(True)


def _fast_and_reference(fast_fn, ref_fn, inputs, grad_out):
    """Outputs and input gradients of both functions on clones of the same inputs."""
    results = []
    for fn in (fast_fn, ref_fn):
        leaves = [None if t is None else _leaf(t) for t in inputs]
        out = fn(*leaves)
        out.backward(grad_out)
        results.append((out.detach(), [None if t is None else t.grad for t in leaves]))
    return results


SOFTMAX_CASES = [
    ((2, 4, 128, 128), True, None),
    ((2, 4, 128, 128), False, (2, 1, 128, 128)),
    ((1, 3, 37, 77), False, (37, 77)),
    ((1, 3, 37, 77), True, (1, 3, 37, 77)),
    ((2, 2, 64, 2048), True, None),
    ((1, 2, 8, 16384), False, None),
]


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape, causal, mask_shape", SOFTMAX_CASES)
def test_scale_mask_softmax_matches_reference(references, dtype, shape, causal, mask_shape):
    torch.manual_seed(0)
    scores = (torch.randn(shape, device="cuda") * 3).to(dtype)
    mask = None if mask_shape is None else torch.rand(mask_shape, device="cuda") < 0.3
    grad_probs = torch.randn(shape, device="cuda").to(dtype)
    (probs, (grad,)), (ref_probs, (ref_grad,)) = _fast_and_reference(
        lambda s: fused_kernels.scale_mask_softmax(s, mask, 0.125, causal, True),
        lambda s: references.scale_mask_softmax_reference(s, mask, 0.125, causal, True),
        [scores],
        grad_probs,
    )
    _assert_matches(probs, ref_probs, ulps=2, reduced=shape[-1])
    _assert_matches(grad, ref_grad, ulps=8, reduced=shape[-1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_IDS[:2])
def test_softmax_fully_masked_rows(references, dtype):
    torch.manual_seed(1)
    scores = torch.randn(2, 2, 16, 64, device="cuda").to(dtype).transpose(2, 3)  # not contiguous: [2, 2, 64, 16]
    mask = torch.rand(2, 1, 64, 16, device="cuda") < 0.5
    mask[:, :, 3, :] = True
    probs = fused_kernels.scale_mask_softmax(scores, mask, 1.0, False, False)
    torch.testing.assert_close(probs[:, :, 3, :].float(), torch.full_like(probs[:, :, 3, :].float(), 1 / 16))
    _assert_matches(probs, references.scale_mask_softmax_reference(scores, mask, 1.0, False, False), ulps=4)


def test_softmax_falls_back_beyond_the_key_limit():
    scores = torch.randn(1, 1, 2, training_ops.MAX_SOFTMAX_KEYS + 1, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(
        fused_kernels.scale_mask_softmax(scores, None, 1.0, False, True),
        reference.scale_mask_softmax_reference(scores, None, 1.0, False, True),
    )


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(16, 4, 1024), (7, 3, 1000), (5, 12288), (3, 33)])
def test_layer_norm_matches_reference(references, dtype, shape):
    torch.manual_seed(2)
    hidden = shape[-1]
    x = (torch.randn(shape, device="cuda") * 2 + 0.5).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    bias = (0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    grad_y = torch.randn(shape, device="cuda").to(dtype)
    (y, grads), (ref_y, ref_grads) = _fast_and_reference(
        lambda *t: fused_kernels.layer_norm(*t, 1e-5),
        lambda *t: references.layer_norm_reference(*t, 1e-5),
        [x, weight, bias],
        grad_y,
    )
    _assert_matches(y, ref_y, ulps=2, reduced=hidden)
    _assert_matches(grads[0], ref_grads[0], ulps=8, reduced=hidden)
    rows = x.numel() // hidden
    _assert_matches(grads[1], ref_grads[1], ulps=2, reduced=rows)
    _assert_matches(grads[2], ref_grads[2], ulps=2, reduced=rows)


def test_layer_norm_mixed_dtypes(references):
    torch.manual_seed(3)
    x = torch.randn(512, 8, 256, device="cuda").to(torch.bfloat16).transpose(0, 1)  # [8, 512, 256], strided
    weight = torch.randn(256, device="cuda")
    bias = torch.randn(256, device="cuda")
    grad_y = torch.randn(8, 512, 256, device="cuda").to(torch.bfloat16)
    (y, grads), (ref_y, ref_grads) = _fast_and_reference(
        lambda *t: fused_kernels.layer_norm(*t, 1e-5),
        lambda *t: references.layer_norm_reference(*t, 1e-5),
        [x, weight, bias],
        grad_y,
    )
    assert y.dtype == torch.bfloat16 and grads[1].dtype == torch.float32
    _assert_matches(y, ref_y, ulps=2, reduced=256)
    _assert_matches(grads[0], ref_grads[0], ulps=8, reduced=256)
    # dw is fp32 but sums bf16 products over 4096 rows: bf16 inputs, fp32 sums in another order.
    _assert_matches(grads[1], ref_grads[1], ulps=2, reduced=4096)


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(16, 4, 1024), (7, 3, 1000)])
def test_layer_norm_return_input(references, dtype, shape):
    """y, r = layer_norm(x, return_input=True): x's gradient is dL/dy's through the norm plus dL/dr,
    as when x feeds the norm and a residual branch separately; an unused y passes dL/dr through."""
    torch.manual_seed(2)
    hidden = shape[-1]
    x = (torch.randn(shape, device="cuda") * 2 + 0.5).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    bias = (0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    grad_y, grad_r = torch.randn(shape, device="cuda").to(dtype), torch.randn(shape, device="cuda").to(dtype)

    def both_uses(fn, norm_input):
        leaf = _leaf(norm_input)
        y, r = fn(leaf)
        torch.autograd.backward([y, r], [grad_y, grad_r])
        return y.detach(), r.detach(), leaf.grad

    y, r, grad_x = both_uses(lambda t: fused_kernels.layer_norm(t, weight, bias, 1e-5, return_input=True), x)
    ref_y, _, ref_grad_x = both_uses(lambda t: (references.layer_norm_reference(t, weight, bias, 1e-5), t), x)
    assert torch.equal(r, x)
    _assert_matches(y, ref_y, ulps=2, reduced=hidden)
    # the fused sum rounds once, the reference's twice (the norm's gradient, then the add)
    _assert_matches(grad_x, ref_grad_x, ulps=8, reduced=hidden)
    leaf = _leaf(x)
    _, r = fused_kernels.layer_norm(leaf, weight, bias, 1e-5, return_input=True)
    r.backward(grad_r)
    assert torch.equal(leaf.grad, grad_r)


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(16, 4, 1024), (7, 3, 1000), (5, 12288), (3, 33)])
def test_rms_norm_matches_reference(references, dtype, shape):
    torch.manual_seed(2)
    hidden = shape[-1]
    x = (torch.randn(shape, device="cuda") * 2 + 0.5).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    grad_y = torch.randn(shape, device="cuda").to(dtype)
    (y, grads), (ref_y, ref_grads) = _fast_and_reference(
        lambda *t: fused_kernels.rms_norm(*t, 1e-5),
        lambda *t: references.rms_norm_reference(*t, 1e-5),
        [x, weight],
        grad_y,
    )
    _assert_matches(y, ref_y, ulps=2, reduced=hidden)
    _assert_matches(grads[0], ref_grads[0], ulps=8, reduced=hidden)
    _assert_matches(grads[1], ref_grads[1], ulps=2, reduced=x.numel() // hidden)


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=DTYPE_IDS)
def test_rms_norm_return_input_and_mixed_dtypes(references, dtype):
    """fp32 weights with x in ``dtype``, x strided: y, r = rms_norm(x, return_input=True) gives x the
    norm's gradient plus dL/dr; an unused y passes dL/dr through."""
    torch.manual_seed(3)
    x = torch.randn(512, 8, 256, device="cuda").to(dtype).transpose(0, 1)  # [8, 512, 256], strided
    weight = 1 + 0.1 * torch.randn(256, device="cuda")
    grad_y, grad_r = (torch.randn(8, 512, 256, device="cuda").to(dtype) for _ in range(2))

    def both_uses(fn):
        leaf, weight_leaf = _leaf(x), _leaf(weight)
        y, r = fn(leaf, weight_leaf)
        torch.autograd.backward([y, r], [grad_y, grad_r])
        return y.detach(), r.detach(), leaf.grad, weight_leaf.grad

    y, r, grad_x, grad_weight = both_uses(lambda t, w: fused_kernels.rms_norm(t, w, 1e-6, return_input=True))
    ref_y, _, ref_grad_x, ref_grad_weight = both_uses(lambda t, w: (references.rms_norm_reference(t, w, 1e-6), t))
    assert torch.equal(r, x) and y.dtype == dtype and grad_weight.dtype == torch.float32
    _assert_matches(y, ref_y, ulps=2, reduced=256)
    _assert_matches(grad_x, ref_grad_x, ulps=8, reduced=256)
    _assert_matches(grad_weight, ref_grad_weight, ulps=2, reduced=4096)
    leaf = _leaf(x)
    _, r = fused_kernels.rms_norm(leaf, weight, 1e-6, return_input=True)
    r.backward(grad_r)
    assert torch.equal(leaf.grad, grad_r)


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=DTYPE_IDS)
@pytest.mark.parametrize("seq, batch, groups, queries, head_dim, with_bias",
                         [(64, 3, 4, 1, 128, True), (33, 2, 3, 1, 80, True), (7, 1, 2, 1, 64, False),
                          (64, 2, 2, 4, 128, True), (33, 3, 3, 3, 80, False), (16, 2, 1, 8, 64, True)])
def test_qkv_split(references, dtype, seq, batch, groups, queries, head_dim, with_bias):
    """Multi-head (q = 1), grouped-query and multi-query layouts: dq as attention's backward leaves it
    (a [b, np, s, hn] tensor seen as [s, b, np, hn]), dk contiguous, dv with its batch and position
    strides swapped; then without a value gradient, then without a query gradient."""
    torch.manual_seed(8)
    heads, width = groups * queries, groups * (queries + 2) * head_dim
    mixed = torch.randn(seq, batch, width, device="cuda").to(dtype)
    bias = torch.randn(width, device="cuda").to(dtype) if with_bias else None
    grad_query = torch.randn(batch, heads, seq, head_dim, device="cuda").to(dtype).permute(2, 0, 1, 3)
    grad_key = torch.randn(seq, batch, groups, head_dim, device="cuda").to(dtype)
    grad_value = torch.randn(batch, seq, groups, head_dim, device="cuda").to(dtype).transpose(0, 1)
    for grads in ((grad_query, grad_key, grad_value), (grad_query, grad_key, None), (None, grad_key, grad_value)):
        results = []
        for split in (fused_kernels.split_query_key_value, references.split_query_key_value_reference):
            leaf, bias_leaf = _leaf(mixed), None if bias is None else _leaf(bias)
            parts = split(leaf, bias_leaf, head_dim, queries)
            used = [(part, grad) for part, grad in zip(parts, grads) if grad is not None]
            torch.autograd.backward([part for part, _ in used], [grad for _, grad in used])
            results.append(([part.detach() for part in parts], leaf.grad, None if bias is None else bias_leaf.grad))
        (parts, grad_mixed, grad_bias), (ref_parts, ref_grad_mixed, ref_grad_bias) = results
        assert [part.shape for part in parts] == [(seq, batch, heads, head_dim)] + 2 * [(seq, batch, groups, head_dim)]
        assert all(torch.equal(part, ref) for part, ref in zip(parts, ref_parts))
        assert torch.equal(grad_mixed, ref_grad_mixed)  # a copy, exact
        if with_bias:
            _assert_matches(grad_bias, ref_grad_bias, ulps=2, reduced=seq * batch)


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(16, 4, 4096), (7, 3, 1000), (1, 33), (2, 3000)])
def test_bias_gelu_matches_reference(references, dtype, shape):
    torch.manual_seed(4)
    y = (torch.randn(shape, device="cuda") * 3).to(dtype)
    bias = torch.randn(shape[-1], device="cuda").to(dtype)
    grad_out = torch.randn(shape, device="cuda").to(dtype)
    (out, (grad_bias, grad_y)), (ref_out, (ref_grad_bias, ref_grad_y)) = _fast_and_reference(
        fused_kernels.bias_gelu, references.bias_gelu_reference, [bias, y], grad_out
    )
    # The kernel adds the bias in fp32; the reference rounds y + bias to the dtype first.
    _assert_matches(out, ref_out, ulps=4)
    _assert_matches(grad_y, ref_grad_y, ulps=8)
    _assert_matches(grad_bias, ref_grad_bias, ulps=8, reduced=y.numel() // shape[-1])


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=DTYPE_IDS)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", [(2, 64, 1000), (300, 7, 2048)])
def test_bias_dropout_add_no_dropout(references, dtype, with_bias, shape):
    torch.manual_seed(5)
    x, residual = torch.randn(shape, device="cuda").to(dtype), torch.randn(shape, device="cuda").to(dtype)
    bias = torch.randn(shape[-1], device="cuda").to(dtype) if with_bias else None
    grad_out = torch.randn_like(x)
    for prob, training in ((0.3, False), (0.0, True)):
        (out, grads), (ref_out, ref_grads) = _fast_and_reference(
            lambda *t: fused_kernels.bias_dropout_add(*t, prob, training),
            lambda *t: references.bias_dropout_add_reference(*t, prob, training),
            [x, bias, residual],
            grad_out,
        )
        _assert_matches(out, ref_out, ulps=2)
        assert torch.equal(grads[0], ref_grads[0]) and torch.equal(grads[2], ref_grads[2])
        if with_bias:
            _assert_matches(grads[1], ref_grads[1], ulps=2, reduced=x.numel() // shape[-1])


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(32, 4, 1024), (7, 3, 1000)])
def test_bias_dropout_add_dropout(references, dtype, shape):
    torch.manual_seed(6)
    prob = 0.2
    x = (torch.rand(shape, device="cuda") + 0.5).to(dtype).requires_grad_(True)
    bias = (torch.rand(shape[-1], device="cuda") + 0.1).to(dtype).requires_grad_(True)
    residual = torch.randn(shape, device="cuda").to(dtype).requires_grad_(True)
    out = fused_kernels.bias_dropout_add(x, bias, residual, prob, True)
    grad_out = torch.ones_like(out)
    out.backward(grad_out)
    kept = x.grad != 0  # grad_x = keep / (1 - prob)
    _assert_matches(x.grad, torch.where(kept, 1 / (1 - prob), 0.0).to(dtype), ulps=1)
    expected = residual.double() + torch.where(kept, (x.double() + bias.double()) / (1 - prob), 0.0)
    _assert_matches(out, expected.to(dtype), ulps=4)
    assert torch.equal(residual.grad, grad_out)
    torch.testing.assert_close(bias.grad.double(), x.grad.double().reshape(-1, shape[-1]).sum(0), rtol=1e-2, atol=1e-2)
    keep_rate = kept.double().mean().item()
    assert abs(keep_rate - (1 - prob)) < 6 * math.sqrt(prob * (1 - prob) / kept.numel())
    # Each Philox counter feeds 4 neighbouring columns: each lane keeps at 1 - prob, independently.
    lanes = kept[..., : shape[-1] // 4 * 4].reshape(-1, 4).double()  # [n, 4]
    for rate in lanes.mean(0).tolist():
        assert abs(rate - (1 - prob)) < 6 * math.sqrt(prob * (1 - prob) / lanes.shape[0])
    both = (lanes[:, 0] * lanes[:, 1]).mean().item()
    assert abs(both - (1 - prob) ** 2) < 6 * math.sqrt((1 - prob) ** 2 * (1 - (1 - prob) ** 2) / lanes.shape[0])


def test_bias_dropout_add_checkpoint_replay(references):
    torch.manual_seed(7)
    x = torch.randn(64, 4, 512, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    state = torch.cuda.get_rng_state()
    first = fused_kernels.bias_dropout_add(x, bias, residual, 0.3, True)
    second = fused_kernels.bias_dropout_add(x, bias, residual, 0.3, True)
    torch.cuda.set_rng_state(state)
    assert torch.equal(fused_kernels.bias_dropout_add(x, bias, residual, 0.3, True), first)
    assert not torch.equal(first, second)

    def block(inputs):
        return fused_kernels.bias_dropout_add(inputs, bias, residual, 0.3, True) * 2

    grad_out = torch.randn_like(x)
    plain, checkpointed = _leaf(x), _leaf(x)
    torch.cuda.manual_seed(11)
    out_plain = block(plain)
    out_plain.backward(grad_out)
    torch.cuda.manual_seed(11)
    out_checkpointed = torch.utils.checkpoint.checkpoint(block, checkpointed, use_reentrant=False)
    out_checkpointed.backward(grad_out)
    assert torch.equal(out_plain, out_checkpointed)
    assert torch.equal(plain.grad, checkpointed.grad)


def test_disabled_kernels_use_the_references_on_cuda():
    fused_kernels.set_fused_kernels_enabled(False)
    try:
        x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
        weight, bias = torch.randn(256, device="cuda"), torch.randn(256, device="cuda")
        assert torch.equal(fused_kernels.layer_norm(x, weight, bias, 1e-5), reference.layer_norm_reference(x, weight, bias, 1e-5))
    finally:
        fused_kernels.set_fused_kernels_enabled(None)


@pytest.fixture
def no_cublas_linear(monkeypatch):
    """F.linear inside the public ops raises: a call that returns took the GEMV."""
    monkeypatch.setattr(decode_ops, "F", SimpleNamespace(linear=forbidden("F.linear")))


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=DTYPE_IDS)
@pytest.mark.parametrize("n, k, with_bias", [(6144, 2048, True), (2048, 8192, False), (50304, 2048, False),
                                             (37, 1000, True)])
def test_one_row_linear_runs_the_gemv(dtype, n, k, with_bias, no_cublas_linear):
    torch.manual_seed(2)
    x = torch.randn(1, 1, k, device="cuda").to(dtype)
    weight = (torch.randn(n, k, device="cuda") / math.sqrt(k)).to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype) if with_bias else None
    expected = torch.addmm(bias.double() if with_bias else torch.zeros(n, dtype=torch.float64, device="cuda"),
                           x.double().view(1, k), weight.double().t()).view(1, 1, n)
    with torch.no_grad():
        y = fused_kernels.linear(x, weight, bias)
    _assert_matches(y, expected.to(dtype), ulps=1, reduced=k)


def _normed_product(x, norm_weight, norm_bias, weight, bias, norm="layer"):
    """round(N(x)) W^T + b in float64, the norm (LayerNorm, or RMSNorm when ``norm`` is "rms") in
    fp32 rounded to x's dtype as the kernel's prologue does."""
    if norm == "rms":
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_weight.float()).to(x.dtype)
    else:
        normed = F.layer_norm(x.float(), (x.shape[-1],), norm_weight.float(), norm_bias.float(), 1e-5).to(x.dtype)
    return F.linear(normed.double(), weight.double(), None if bias is None else bias.double())


def _activation_float64(y, activation):
    if activation == "swiglu":
        linear, gate = y.chunk(2, dim=-1)
        return linear * gate * torch.sigmoid(gate)
    return y if activation is None else F.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=DTYPE_IDS)
@pytest.mark.parametrize("n, k, activation, norm, with_bias",
                         [(6144, 2048, None, "layer", True), (8192, 2048, "gelu_tanh", "layer", True),
                          (37, 1000, "gelu", "layer", True), (50304, 2048, None, "layer", True),
                          (16, 3000, "gelu_tanh", "layer", True), (64, 5000, "gelu", "layer", True),
                          (3072, 2048, None, "rms", False), (16384, 2048, "swiglu", "rms", False),
                          (38, 1000, "swiglu", "rms", True), (64, 5000, "swiglu", "layer", True),
                          (128256, 2048, None, "rms", False), (40, 3000, "gelu", "rms", False)])
def test_layer_norm_linear_gemv(references, dtype, n, k, activation, norm, with_bias, no_cublas_linear):
    """LayerNorm and RMSNorm prologues, GeLU and SwiGLU epilogues (a [2n', K] weight giving n'
    outputs), with and without biases, against float64."""
    torch.manual_seed(5)
    x = (torch.randn(1, 1, k, device="cuda") * 4 + 2).to(dtype)
    norm_weight = torch.randn(k, device="cuda").to(dtype)
    norm_bias = torch.randn(k, device="cuda").to(dtype) if norm == "layer" else None
    weight = (torch.randn(n, k, device="cuda") / math.sqrt(k)).to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype) if with_bias else None
    expected = _activation_float64(_normed_product(x, norm_weight, norm_bias, weight, bias, norm), activation)
    with torch.no_grad():
        y = fused_kernels.layer_norm_linear(x, norm_weight, norm_bias, 1e-5, weight, bias, activation, norm=norm)
    assert y.shape == (1, 1, n // 2 if activation == "swiglu" else n)
    _assert_matches(y, expected.to(dtype), ulps=3 if activation == "swiglu" else 2, reduced=k)


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=DTYPE_IDS)
@pytest.mark.parametrize("n, k, with_bias", [(2048, 2048, True), (2048, 8192, True), (37, 1000, False)])
def test_linear_with_a_residual_runs_the_gemv(references, dtype, n, k, with_bias, no_cublas_linear):
    torch.manual_seed(6)
    x = torch.randn(1, 1, k, device="cuda").to(dtype)
    weight = (torch.randn(n, k, device="cuda") / math.sqrt(k)).to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype) if with_bias else None
    residual = (torch.randn(1, 1, n, device="cuda") * 3).to(dtype)
    expected = residual.double() + F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    with torch.no_grad():
        y = fused_kernels.linear(x, weight, bias, residual)
    _assert_matches(y, expected.to(dtype), ulps=2, reduced=k)


def test_linear_falls_back_to_torch():
    x = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fused_kernels.linear(x, weight).sum().backward()
    assert x.grad is not None and weight.grad is not None
    rows = torch.randn(2, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(fused_kernels.linear(rows, weight), F.linear(rows, weight))


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=DTYPE_IDS)
@pytest.mark.parametrize("batch, heads, groups, capacity, head_dim, position, alibi",
                         [(1, 16, 16, 384, 128, 255, False), (32, 16, 16, 384, 128, 383, False),
                          (2, 3, 3, 100, 80, 0, True), (1, 4, 4, 2048, 64, 1500, True), (1, 2, 2, 9000, 64, 8999, False),
                          (1, 32, 8, 4096, 64, 3000, False), (32, 32, 8, 384, 64, 200, True),
                          (3, 6, 1, 100, 80, 99, False)])
def test_decode_attention_matches_reference(references, dtype, batch, heads, groups, capacity, head_dim, position,
                                            alibi):
    """Multi-head (groups = heads), grouped-query and multi-query caches; the query strided as the
    model's split leaves it."""
    torch.manual_seed(3)
    keys, values = (torch.randn(batch, groups, capacity, head_dim, device="cuda").to(dtype) for _ in range(2))
    mixed = torch.randn(1, batch, heads, 3 * head_dim, device="cuda").to(dtype)  # the model's strided query
    query = mixed.split(head_dim, dim=-1)[0].permute(1, 2, 0, 3)
    slopes = torch.rand(heads, device="cuda") if alibi else None
    where = torch.tensor([position], device="cuda")
    out = fused_kernels.decode_attention(query, keys, values, where, slopes, head_dim ** -0.5)
    expected = references.decode_attention_reference(query.double(), keys.double(), values.double(), where,
                                                     slopes, head_dim ** -0.5)
    _assert_matches(out, expected.to(dtype), ulps=2, reduced=position + 1)


def test_decode_attention_every_position(references):
    """Calls queued back to back at every position of the cache (the chunk holding the position, the
    empty chunks after it, the first and the last position), each equal to the reference."""
    torch.manual_seed(7)
    for batch in (1, 32):
        keys, values = (torch.randn(batch, 16, 384, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        query = torch.randn(batch, 16, 1, 128, device="cuda", dtype=torch.bfloat16)
        positions = [torch.tensor([p], device="cuda") for p in range(384)]
        outputs = [fused_kernels.decode_attention(query, keys, values, p, None, 0.1) for p in positions]
        for where, out in zip(positions, outputs):
            expected = references.decode_attention_reference(query.double(), keys.double(), values.double(), where,
                                                             None, 0.1)
            _assert_matches(out, expected.to(torch.bfloat16), ulps=2, reduced=int(where) + 1)


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=DTYPE_IDS)
@pytest.mark.parametrize("batch, groups, position, alibi", [(1, 4, 0, False), (1, 4, 200, True), (3, 4, 383, False),
                                                            (1, 2, 200, False), (3, 1, 17, True)])
def test_decode_attention_writes_cache(references, dtype, batch, groups, position, alibi):
    """4 query heads over ``groups`` key/value groups; the step's key and value strided as the split
    of the model's [per group q queries, key, value] rows leaves them."""
    torch.manual_seed(8)
    queries = 4 // groups
    keys, values = (torch.randn(batch, groups, 384, 96, device="cuda").to(dtype) for _ in range(2))
    mixed = torch.randn(1, batch, groups, (queries + 2) * 96, device="cuda").to(dtype)
    query = mixed[..., :queries * 96].reshape(1, batch, 4, 96).permute(1, 2, 0, 3)
    key, value = (t.permute(1, 2, 0, 3) for t in mixed[..., queries * 96:].split(96, dim=-1))
    slopes = torch.rand(4, device="cuda") if alibi else None
    where = torch.tensor([position], device="cuda")
    expected_keys, expected_values = keys.clone(), values.clone()
    expected_keys[:, :, position], expected_values[:, :, position] = key[:, :, 0], value[:, :, 0]
    out = fused_kernels.decode_attention(query, keys, values, where, slopes, 0.1, key, value)
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
    expected = references.decode_attention_reference(query.double(), keys.double(), values.double(), where, slopes,
                                                     0.1)
    _assert_matches(out, expected.to(dtype), ulps=2, reduced=position + 1)


@pytest.mark.parametrize("dtype", HALF_AND_FULL, ids=DTYPE_IDS)
@pytest.mark.parametrize("batch, groups, rotary_dim, position, shared", [(1, 2, 64, 200, False), (3, 8, 32, 17, False),
                                                                        (2, 4, 64, 0, False), (4, 2, 64, 30, True)])
def test_decode_attention_reads_projection_rows_and_turns_them(references, dtype, batch, groups, rotary_dim, position,
                                                               shared):
    """8 query heads over ``groups`` groups read where the QKV projection's [g, q + 2, hn] rows hold
    them, turned by the rotary embedding in the kernel (all or half of the 64 channels) at positions
    other than the cache slot (``shared``: one position expanded over the rows, stride 0): the cache
    gets the turned key and the output is the reference's attention of the turned query."""
    torch.manual_seed(10)
    heads, head_dim, queries = 8, 64, 8 // groups
    keys, values = (torch.randn(batch, groups, 256, head_dim, device="cuda").to(dtype) for _ in range(2))
    mixed = torch.randn(1, batch, groups * (queries + 2) * head_dim, device="cuda").to(dtype)
    rows = mixed.view(1, batch, groups, queries + 2, head_dim).permute(1, 2, 3, 0, 4)  # [b, g, q + 2, 1, hn]
    query, key, value = rows[:, :, :queries], rows[:, :, queries], rows[:, :, queries + 1]
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, device="cuda") / rotary_dim)
    positions = torch.arange(batch, device="cuda") * 5 + position + 3
    if shared:
        positions = torch.tensor([[position + 3]], device="cuda").expand(batch, 1)
    where = torch.tensor([position], device="cuda")
    turned_query, turned_key = fused_kernels.rotary_embedding_reference(
        query.reshape(batch, heads, 1, head_dim).permute(2, 0, 1, 3), key.permute(2, 0, 1, 3),
        positions.reshape(batch, 1), inv_freq)
    expected_keys, expected_values = keys.clone(), values.clone()
    expected_keys[:, :, position], expected_values[:, :, position] = turned_key[:, :, 0], value[:, :, 0]
    out = fused_kernels.decode_attention(query, keys, values, where, None, 0.125, key, value, (inv_freq, positions))
    _assert_matches(keys, expected_keys, ulps=1)
    assert torch.equal(values, expected_values)
    expected = references.decode_attention_reference(turned_query.double(), keys.double(), values.double(), where,
                                                     None, 0.125)
    _assert_matches(out, expected.to(dtype), ulps=2, reduced=position + 1)


def test_chained_decode_kernels(references, no_cublas_linear):
    """Each kernel reads what the one before it wrote, back to back in one stream (on Hopper each
    starts before its predecessor ends and waits only before reading), eagerly and replayed from a
    CUDA graph: a layer's five ops, 24 layers over, each output equal to the float64 reference of
    the inputs it was given."""
    torch.manual_seed(9)
    hidden, heads, head_dim, layers = 256, 4, 64, 24
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    shapes = dict(qkv=(3 * hidden, hidden), dense=(hidden, hidden), fc1=(4 * hidden, hidden), fc2=(hidden, 4 * hidden))
    weights = [{name: (torch.randn(shape, **bf16) / math.sqrt(shape[1]), torch.randn(shape[0], **bf16) / 8)
                for name, shape in shapes.items()} for _ in range(layers)]
    norm = (torch.rand(hidden, **bf16) + 0.5, torch.randn(hidden, **bf16) / 8)
    caches = [[torch.randn(1, heads, 32, head_dim, **bf16) for _ in range(2)] for _ in range(layers)]
    where = torch.tensor([17], device="cuda")

    def step(x, records):
        for layer, (keys, values) in zip(weights, caches):
            mixed = fused_kernels.layer_norm_linear(x, *norm, 1e-5, *layer["qkv"])
            query, key, value = (t.permute(1, 2, 0, 3) for t in mixed.view(1, 1, heads, 3 * head_dim).split(head_dim, -1))
            context = fused_kernels.decode_attention(query, keys, values, where, None, 0.125, key, value)
            context = context.view(1, 1, hidden)
            after_attention = fused_kernels.linear(context, *layer["dense"], x)
            intermediate = fused_kernels.layer_norm_linear(after_attention, *norm, 1e-5, *layer["fc1"], "gelu_tanh")
            output = fused_kernels.linear(intermediate, *layer["fc2"], after_attention)
            records.append((x, mixed, (keys, values), context, after_attention, intermediate, output))
            x = output

    def check(records):
        for layer, (x, mixed, (keys, values), context, after_attention, intermediate, output) in zip(weights, records):
            _assert_matches(mixed, _normed_product(x, *norm, *layer["qkv"]).to(mixed.dtype), ulps=2, reduced=hidden)
            query = mixed.view(1, 1, heads, 3 * head_dim)[..., :head_dim].permute(1, 2, 0, 3)
            expected = references.decode_attention_reference(query.double(), keys.double(), values.double(), where,
                                                             None, 0.125)
            _assert_matches(context, expected.view(1, 1, hidden).to(context.dtype), ulps=2, reduced=18)
            dense = x.double() + F.linear(context.double(), *(t.double() for t in layer["dense"]))
            _assert_matches(after_attention, dense.to(x.dtype), ulps=3, reduced=hidden)
            fc1 = F.gelu(_normed_product(after_attention, *norm, *layer["fc1"]), approximate="tanh")
            _assert_matches(intermediate, fc1.to(x.dtype), ulps=3, reduced=hidden)
            fc2 = after_attention.double() + F.linear(intermediate.double(), *(t.double() for t in layer["fc2"]))
            _assert_matches(output, fc2.to(x.dtype), ulps=3, reduced=4 * hidden)

    x = torch.randn(1, 1, hidden, **bf16)
    with torch.no_grad():
        eager = []
        step(x, eager)
        check(eager)
        replayed = []
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(x, replayed)
        graph.replay()
        check(replayed)


def test_decode_kernels_in_cuda_graph(references, no_cublas_linear):
    """The decode ops under torch.compile, then captured: a replay at a new position writes the
    cache there and gives the eager result."""
    torch.manual_seed(4)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    qkv, dense = torch.randn(3 * 384, 384, **bf16) / 20, torch.randn(384, 384, **bf16) / 20
    norm = (torch.rand(384, **bf16) + 0.5, torch.randn(384, **bf16) / 8)
    keys, values = (torch.randn(1, 4, 64, 96, **bf16) for _ in range(2))
    where = torch.tensor([10], device="cuda")

    def step(x):
        mixed = fused_kernels.layer_norm_linear(x, *norm, 1e-5, qkv).view(1, 1, 4, 3 * 96)
        query, key, value = (t.permute(1, 2, 0, 3) for t in mixed.split(96, dim=-1))
        context = fused_kernels.decode_attention(query, keys, values, where, None, 0.1, key, value)
        return fused_kernels.linear(context.view(1, 1, 384), dense, None, x)

    x = torch.randn(1, 1, 384, **bf16)
    with torch.no_grad():
        eager = step(x)
        compiled = torch.compile(step, fullgraph=True)
        assert torch.equal(compiled(x), eager)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = compiled(x)
        where.fill_(40)
        keys[:, :, 40].zero_()
        graph.replay()
        written = keys[:, :, 40].clone()
        assert written.abs().sum() > 0
        assert torch.equal(replayed, step(x)) and torch.equal(keys[:, :, 40], written)


def test_llama_decode_step_in_cuda_graph(references, no_cublas_linear):
    """A Llama-style layer's decode ops (RMSNorm + QKV of 8 heads over 2 groups, no biases, the
    grouped cache written by attention, dense + residual, RMSNorm + SwiGLU, down projection +
    residual) under torch.compile, then captured: a replay at a new position writes the cache there
    and gives the eager result, and each output equals its float64 reference."""
    torch.manual_seed(10)
    hidden, heads, groups, head_dim, ffn = 512, 8, 2, 64, 1024
    queries = heads // groups
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(groups * (queries + 2) * head_dim, hidden, **bf16) / math.sqrt(hidden)
    dense = torch.randn(hidden, heads * head_dim, **bf16) / math.sqrt(hidden)
    fc1, fc2 = torch.randn(2 * ffn, hidden, **bf16) / math.sqrt(hidden), torch.randn(hidden, ffn, **bf16) / 32
    norms = [torch.rand(hidden, **bf16) + 0.5 for _ in range(2)]
    keys, values = (torch.randn(1, groups, 64, head_dim, **bf16) for _ in range(2))
    where = torch.tensor([10], device="cuda")

    def step(x):
        mixed = fused_kernels.layer_norm_linear(x, norms[0], None, 1e-5, qkv, norm="rms")
        rows = mixed.view(1, 1, groups, queries + 2, head_dim)
        query = rows[:, :, :, :queries].reshape(1, 1, heads, head_dim).permute(1, 2, 0, 3)
        key, value = (rows[:, :, :, i].permute(1, 2, 0, 3) for i in (queries, queries + 1))
        context = fused_kernels.decode_attention(query, keys, values, where, None, head_dim ** -0.5, key, value)
        after_attention = fused_kernels.linear(context.view(1, 1, heads * head_dim), dense, None, x)
        intermediate = fused_kernels.layer_norm_linear(after_attention, norms[1], None, 1e-5, fc1, None, "swiglu",
                                                       norm="rms")
        return mixed, context, after_attention, intermediate, fused_kernels.linear(intermediate, fc2, None,
                                                                                   after_attention)

    def check(x, outputs):
        mixed, context, after_attention, intermediate, output = outputs
        _assert_matches(mixed, _normed_product(x, norms[0], None, qkv, None, "rms").to(mixed.dtype), ulps=2,
                        reduced=hidden)
        query = mixed.view(1, 1, groups, queries + 2, head_dim)[:, :, :, :queries].reshape(1, heads, 1, head_dim)
        expected = references.decode_attention_reference(query.double(), keys.double(), values.double(), where,
                                                         None, head_dim ** -0.5)
        _assert_matches(context, expected.to(context.dtype), ulps=2, reduced=int(where) + 1)
        swiglu = _activation_float64(_normed_product(after_attention, norms[1], None, fc1, None, "rms"), "swiglu")
        _assert_matches(intermediate, swiglu.to(intermediate.dtype), ulps=3, reduced=hidden)
        down = after_attention.double() + F.linear(intermediate.double(), fc2.double())
        _assert_matches(output, down.to(output.dtype), ulps=3, reduced=ffn)

    x = torch.randn(1, 1, hidden, **bf16)
    with torch.no_grad():
        eager = step(x)
        check(x, eager)
        compiled = torch.compile(step, fullgraph=True)
        assert all(torch.equal(a, b) for a, b in zip(compiled(x), eager))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = compiled(x)
        where.fill_(40)
        keys[:, :, 40].zero_()
        graph.replay()
        assert keys[:, :, 40].abs().sum() > 0
        check(x, replayed)
        assert all(torch.equal(a, b) for a, b in zip(replayed, step(x)))


def _assert_adamw_close(got, want):
    """Within 8 fp32 ulps of each value and of the largest: torch's kernel computes the moments in
    float64 before rounding them, so where beta * m and (1 - beta) * g cancel, an element keeps only
    the absolute error of its terms."""
    ulps = 8 * torch.finfo(torch.float32).eps
    torch.testing.assert_close(got, want, rtol=ulps, atol=ulps * want.abs().max().item())


def _torch_fused_adamw(param, steps, weight_decay, grad_scale):
    """torch's fused AdamW over ``steps`` gradients: (param, exp_avg, exp_avg_sq) after them."""
    param = torch.nn.Parameter(param.clone())
    optimizer = torch.optim.AdamW([param], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay,
                                  fused=True)
    for grad in steps:
        param.grad = grad.clone()
        optimizer.grad_scale = grad_scale
        optimizer.step()
    state = optimizer.state[param]
    return param.detach(), state["exp_avg"], state["exp_avg_sq"]


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16, None], ids=["bf16", "fp16", "no_copy"])
@pytest.mark.parametrize("weight_decay, clipped", [(0.1, True), (0.0, False)])
def test_adamw_step(references, copy_dtype, weight_decay, clipped):
    """Three steps on an odd-sized flat tensor: torch's fused kernel's results within fp32 roundings;
    the copy is exactly the new fp32 weights in its dtype; the gradient is left as it was."""
    torch.manual_seed(5)
    n = (1 << 20) + 7
    param = torch.randn(n, device="cuda")
    steps = [torch.randn(n, device="cuda") * scale for scale in (1.0, 1e-3, 30.0)]
    grad_scale = torch.tensor(2.5, device="cuda") if clipped else None
    expected = _torch_fused_adamw(param, steps, weight_decay, grad_scale)
    ours, exp_avg, exp_avg_sq = param.clone(), torch.zeros_like(param), torch.zeros_like(param)
    copy = None if copy_dtype is None else torch.empty(n, device="cuda", dtype=copy_dtype)
    step = torch.zeros((), device="cuda")
    for grad in steps:
        kept = grad.clone()
        step += 1
        fused_kernels.adamw_step(ours, grad, exp_avg, exp_avg_sq, step, lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                                 weight_decay=weight_decay, grad_scale=grad_scale, param_copy=copy)
        assert torch.equal(grad, kept)
        if copy is not None:
            assert torch.equal(copy, ours.to(copy_dtype))
    for got, want in zip((ours, exp_avg, exp_avg_sq), expected):
        _assert_adamw_close(got, want)
    assert not torch.equal(ours, param)


def test_adamw_step_past_2_to_the_31(references):
    """A flat partition of more than 2^31 elements (int64 offsets): its last elements step as the
    reference steps them."""
    n = (1 << 31) + 1000
    param, grad = torch.full((n,), 0.5, device="cuda"), torch.ones(n, device="cuda")
    grad[-1000:] = torch.linspace(-2.0, 2.0, 1000, device="cuda")
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    step, copy = torch.ones((), device="cuda"), torch.empty(n, device="cuda", dtype=torch.bfloat16)
    tail = [t[-1000:].clone() for t in (param, grad, exp_avg, exp_avg_sq)]
    settings = dict(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    fused_kernels.adamw_step(param, grad, exp_avg, exp_avg_sq, step, param_copy=copy, **settings)
    references.adamw_step_reference(*tail, step, **settings)
    for got, want in zip((param[-1000:], exp_avg[-1000:], exp_avg_sq[-1000:]), (tail[0], tail[2], tail[3])):
        _assert_adamw_close(got, want)
    assert torch.equal(copy[-1000:], param[-1000:].bfloat16()) and float(param[0]) != 0.5
