"""The plain-torch references against direct formulas, in float64 and in the half dtypes."""
import math

import pytest
import torch

from megatron.core.fused_kernels import (
    adamw_step_reference,
    bias_dropout_add_reference,
    bias_gelu_reference,
    causal_mask,
    decode_attention_reference,
    layer_norm_linear_reference,
    layer_norm_reference,
    linear_reference,
    rms_norm_reference,
    scale_mask_softmax_reference,
    split_query_key_value_reference,
)


def _softmax_formula(scores, masked, scale):
    """exp(scale s - max) / sum over visible keys; masked keys 0; a fully masked row uniform."""
    x = scores * scale
    visible = ~masked
    x_max = torch.where(visible, x, torch.full_like(x, -math.inf)).amax(-1, keepdim=True)
    numerators = torch.where(visible, torch.exp(x - x_max), torch.zeros_like(x))
    probs = numerators / numerators.sum(-1, keepdim=True)
    uniform = torch.full_like(x, 1.0 / x.shape[-1])
    return torch.where(visible.any(-1, keepdim=True), probs, uniform)


def test_causal_mask():
    assert torch.equal(causal_mask(4, 4), torch.triu(torch.ones(4, 4, dtype=torch.bool), diagonal=1))
    # 2 queries at absolute positions 3 and 4 of 5: query 0 sees keys 0..3, query 1 sees all.
    expected = torch.tensor([[0, 0, 0, 0, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(causal_mask(2, 5), expected)
    with pytest.raises(ValueError, match="sq <= sk"):
        causal_mask(5, 4)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_softmax_reference_matches_formula_in_float64(causal, with_mask):
    torch.manual_seed(0)
    b, heads, sq, sk = 2, 3, 6, 6
    scores = torch.randn(b, heads, sq, sk, dtype=torch.float64) * 4
    mask = torch.rand(b, 1, sq, sk) < 0.4 if with_mask else None
    if with_mask:
        mask[1, 0, 2, :] = True  # a fully masked row
    masked = torch.zeros(b, heads, sq, sk, dtype=torch.bool)
    if causal:
        masked = masked | causal_mask(sq, sk)
    if with_mask:
        masked = masked | mask
    probs = scale_mask_softmax_reference(scores, mask, 0.37, causal, softmax_in_fp32=True)
    assert probs.dtype == torch.float64
    torch.testing.assert_close(probs, _softmax_formula(scores, masked, 0.37), rtol=1e-12, atol=1e-14)
    assert torch.all(probs[masked & masked.logical_not().any(-1, keepdim=True)] == 0)
    torch.testing.assert_close(probs.sum(-1), torch.ones(b, heads, sq, dtype=torch.float64))


def test_softmax_reference_gradient_matches_formula():
    torch.manual_seed(1)
    scores = torch.randn(2, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 1, 5, 5) < 0.3
    mask[0, 0, 4, :] = True
    scale = 0.5
    probs = scale_mask_softmax_reference(scores, mask, scale, True, softmax_in_fp32=True)
    grad_probs = torch.randn_like(probs)
    probs.backward(grad_probs)
    masked = mask | causal_mask(5, 5)
    p = probs.detach()
    expected = scale * p * (grad_probs - (p * grad_probs).sum(-1, keepdim=True))
    expected = torch.where(masked, torch.zeros_like(expected), expected)
    torch.testing.assert_close(scores.grad, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("softmax_in_fp32", [True, False])
def test_softmax_reference_half_dtypes(dtype, softmax_in_fp32):
    torch.manual_seed(2)
    scores = (torch.randn(1, 2, 8, 16) * 3).to(dtype)
    mask = torch.rand(1, 1, 8, 16) < 0.2
    probs = scale_mask_softmax_reference(scores, mask, 0.25, False, softmax_in_fp32)
    assert probs.dtype == dtype
    truth = _softmax_formula(scores.double(), mask.expand(1, 2, 8, 16), 0.25)
    tolerance = 4 * torch.finfo(dtype).eps  # a few roundings of the half dtype
    torch.testing.assert_close(probs.double(), truth, rtol=tolerance, atol=tolerance)


def _layer_norm_formula(x, weight, bias, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def test_layer_norm_reference_float64():
    torch.manual_seed(3)
    x = (torch.randn(4, 3, 10, dtype=torch.float64) * 2 + 1).requires_grad_(True)
    weight = torch.randn(10, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(10, dtype=torch.float64, requires_grad=True)
    y = layer_norm_reference(x, weight, bias, 1e-5)
    # F.layer_norm on an fp32 upcast would lose float64 precision: the reference keeps the input's
    # precision when it is higher than fp32.
    torch.testing.assert_close(y, _layer_norm_formula(x, weight, bias, 1e-5), rtol=1e-6, atol=1e-6)
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    xd = x.detach()
    mean = xd.mean(-1, keepdim=True)
    rstd = 1 / torch.sqrt(((xd - mean) ** 2).mean(-1, keepdim=True) + 1e-5)
    x_hat = (xd - mean) * rstd
    g = grad_y * weight.detach()
    expected_grad_x = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True) - g.mean(-1, keepdim=True))
    torch.testing.assert_close(x.grad, expected_grad_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad, (grad_y * x_hat).sum((0, 1)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bias.grad, grad_y.sum((0, 1)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_layer_norm_reference_dtypes(weight_dtype):
    torch.manual_seed(4)
    x = (torch.randn(6, 64) * 3 + 100).to(torch.bfloat16)  # a large mean: bf16 statistics would be poor
    weight = torch.randn(64).to(weight_dtype)
    bias = torch.randn(64).to(weight_dtype)
    y = layer_norm_reference(x, weight, bias, 1e-5)
    assert y.dtype == torch.bfloat16
    truth = _layer_norm_formula(x.double(), weight.double(), bias.double(), 1e-5)
    # one bf16 rounding of the output (2^-8 relative), nothing more
    torch.testing.assert_close(y.double(), truth, rtol=2**-8, atol=2**-8 * truth.abs().max().item())


def _megatron_bias_gelu(bias, y):
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def _megatron_bias_gelu_grad(g, bias, y):
    x = bias + y
    tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
    return ff * g


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_reference(dtype):
    """y = x / sqrt(mean(x^2) + eps) * w element by element in float64; half dtypes within one rounding
    of it (the statistics in fp32); gradients of float64 inputs equal autograd's of the formula."""
    torch.manual_seed(3)
    x64 = torch.randn(3, 2, 10, dtype=torch.float64) * 2 + 1
    w64 = torch.randn(10, dtype=torch.float64)
    expected = torch.stack([torch.stack([torch.stack([x64[i, j, k] / math.sqrt(sum(x64[i, j, m].item() ** 2
                                                                                    for m in range(10)) / 10 + 1e-5)
                                                      * w64[k] for k in range(10)]) for j in range(2)])
                            for i in range(3)])
    y = rms_norm_reference(x64.to(dtype), w64.to(dtype), 1e-5)
    assert y.dtype == dtype
    tolerance = 2 * torch.finfo(dtype).eps if dtype in (torch.bfloat16, torch.float16) else 1e-6
    torch.testing.assert_close(y.double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())
    if dtype == torch.float64:
        x, w = x64.clone().requires_grad_(), w64.clone().requires_grad_()
        grad_y = torch.randn_like(x)
        rms_norm_reference(x, w, 1e-5).backward(grad_y)
        x_formula, w_formula = x64.clone().requires_grad_(), w64.clone().requires_grad_()
        (x_formula / torch.sqrt((x_formula ** 2).mean(-1, keepdim=True) + 1e-5) * w_formula).backward(grad_y)
        torch.testing.assert_close(x.grad, x_formula.grad)
        torch.testing.assert_close(w.grad, w_formula.grad)


def test_bias_gelu_reference():
    torch.manual_seed(5)
    y = (torch.randn(5, 3, 16, dtype=torch.float64) * 3).requires_grad_(True)
    bias = torch.randn(16, dtype=torch.float64, requires_grad=True)
    out = bias_gelu_reference(bias, y)
    # Megatron writes sqrt(2/pi) as 0.79788456 (8 digits), hence the 1e-7 tolerance.
    torch.testing.assert_close(out, _megatron_bias_gelu(bias, y), rtol=1e-7, atol=1e-7)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected = _megatron_bias_gelu_grad(grad_out, bias.detach(), y.detach())
    torch.testing.assert_close(y.grad, expected, rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(bias.grad, expected.sum((0, 1)), rtol=1e-7, atol=1e-6)


def test_bias_dropout_add_reference_no_dropout():
    torch.manual_seed(6)
    x, residual = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    bias = torch.randn(8)
    assert torch.equal(bias_dropout_add_reference(x, bias, residual, 0.3, False), residual + (x + bias))
    assert torch.equal(bias_dropout_add_reference(x, None, residual, 0.0, True), residual + x)


def test_bias_dropout_add_reference_dropout():
    x = torch.rand(64, 4, 256) + 0.5  # away from 0, so kept and dropped elements differ
    bias = torch.rand(256) + 0.1
    residual = torch.randn(64, 4, 256)
    prob = 0.2
    torch.manual_seed(7)
    out = bias_dropout_add_reference(x, bias, residual, prob, True)
    kept = (out - residual).abs() > 1e-6
    torch.testing.assert_close(out[kept], (residual + (x + bias) / (1 - prob))[kept])
    torch.testing.assert_close(out[~kept], residual[~kept])
    keep_rate = kept.double().mean().item()
    sigma = math.sqrt(prob * (1 - prob) / kept.numel())
    assert abs(keep_rate - (1 - prob)) < 6 * sigma
    torch.manual_seed(7)
    assert torch.equal(bias_dropout_add_reference(x, bias, residual, prob, True), out)


@pytest.mark.parametrize("alibi", [False, True], ids=["no bias", "alibi"])
@pytest.mark.parametrize("groups", [6, 2, 1], ids=["multi-head", "grouped", "multi-query"])
def test_decode_attention_reference(alibi, groups):
    """Query head j of 6 reads key/value group j // (6 / g)."""
    torch.manual_seed(5)
    batch, heads, capacity, head_dim, position = 2, 6, 10, 4, 6
    query = torch.randn(batch, heads, 1, head_dim, dtype=torch.float64)
    keys, values = torch.randn(2, batch, groups, capacity, head_dim, dtype=torch.float64)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03, 0.01]) if alibi else None
    out = decode_attention_reference(query, keys, values, torch.tensor([position]), slopes, 0.3)
    for row in range(batch):
        for head in range(heads):
            group = head // (heads // groups)
            seen = range(position + 1)
            logits = torch.stack([0.3 * query[row, head, 0] @ keys[row, group, t]
                                  + (slopes[head] * (t - position) if alibi else 0.0) for t in seen])
            weights = torch.softmax(logits, dim=0)
            expected = sum(weights[t] * values[row, group, t] for t in seen)
            torch.testing.assert_close(out[row, head, 0], expected)


@pytest.mark.parametrize("groups", [3, 1], ids=["multi-head", "multi-query"])
def test_decode_attention_reference_writes_cache(groups):
    torch.manual_seed(6)
    query = torch.randn(2, 3, 1, 4, dtype=torch.float64)
    new_key, new_value = torch.randn(2, 2, groups, 1, 4, dtype=torch.float64)
    keys, values = torch.randn(2, 2, groups, 10, 4, dtype=torch.float64)
    written_keys, written_values = keys.clone(), values.clone()
    written_keys[:, :, 6], written_values[:, :, 6] = new_key[:, :, 0], new_value[:, :, 0]
    expected = decode_attention_reference(query, written_keys, written_values, torch.tensor([6]), None, 0.3)
    out = decode_attention_reference(query, keys, values, torch.tensor([6]), None, 0.3, new_key, new_value)
    assert torch.equal(keys, written_keys) and torch.equal(values, written_values)
    torch.testing.assert_close(out, expected)


def test_linear_reference():
    torch.manual_seed(7)
    x, weight = torch.randn(2, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    bias, residual = torch.randn(3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    expected = torch.stack([torch.stack([residual[i, j] + bias[j] + sum(x[i, k] * weight[j, k] for k in range(5))
                                         for j in range(3)]) for i in range(2)])
    torch.testing.assert_close(linear_reference(x, weight, bias, residual), expected)
    torch.testing.assert_close(linear_reference(x, weight, None, residual), expected - bias)


@pytest.mark.parametrize("activation", [None, "gelu_tanh", "gelu"])
def test_layer_norm_linear_reference(activation):
    torch.manual_seed(8)
    x = torch.randn(2, 1, 6, dtype=torch.float64) * 3 + 1
    norm_weight, norm_bias = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    weight, bias = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    t = ((x - mean) / torch.sqrt(var + 1e-5) * norm_weight + norm_bias) @ weight.T + bias
    expected = {None: t, "gelu_tanh": 0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t ** 3))),
                "gelu": 0.5 * t * (1 + torch.erf(t / math.sqrt(2)))}[activation]
    out = layer_norm_linear_reference(x, norm_weight, norm_bias, 1e-5, weight, bias, activation)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("activation", [None, "swiglu"])
def test_layer_norm_linear_reference_rms_and_swiglu(activation):
    """norm "rms": x / sqrt(mean(x^2) + eps) * w, no bias; "swiglu": the 2n product columns [a | g]
    give a * silu(g), n columns."""
    torch.manual_seed(9)
    x = torch.randn(2, 1, 6, dtype=torch.float64) * 3 + 1
    norm_weight = torch.randn(6, dtype=torch.float64)
    rows = 8 if activation == "swiglu" else 4
    weight, bias = torch.randn(rows, 6, dtype=torch.float64), torch.randn(rows, dtype=torch.float64)
    t = (x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-5) * norm_weight) @ weight.T + bias
    if activation == "swiglu":
        a, g = t[..., :4], t[..., 4:]
        t = a * g / (1 + torch.exp(-g))
    out = layer_norm_linear_reference(x, norm_weight, None, 1e-5, weight, bias, activation, norm="rms")
    assert out.shape == (2, 1, 4)
    torch.testing.assert_close(out, t)


def test_qkv_split_reference():
    """mixed = x W^T + b computed with b's gradient left out: the split hands b the row sum of
    dmixed, so b's gradient is what autograd gives when b is added inside the graph."""
    torch.manual_seed(7)
    seq, batch, heads, head_dim = 5, 3, 2, 4
    x, weight = torch.randn(seq, batch, 6), torch.randn(heads * 3 * head_dim, 6)
    bias = torch.randn(heads * 3 * head_dim, requires_grad=True)
    grads = [torch.randn(seq, batch, heads, head_dim) for _ in range(3)]
    query, key, value = split_query_key_value_reference(torch.nn.functional.linear(x, weight, bias.detach()), bias,
                                                        head_dim)
    mixed = torch.nn.functional.linear(x, weight).view(seq, batch, heads, 3, head_dim) + bias.view(heads, 3, head_dim)
    for part, expected in zip((query, key, value), mixed.unbind(3)):
        torch.testing.assert_close(part, expected)
    torch.autograd.backward([query, key, value], grads)
    expected_grad = torch.stack(grads, dim=3).sum((0, 1)).reshape(-1)  # [heads, 3, head_dim] flattened
    torch.testing.assert_close(bias.grad, expected_grad)
    query, _, _ = split_query_key_value_reference(torch.randn(seq, batch, heads * 3 * head_dim), None, head_dim)
    assert query.shape == (seq, batch, heads, head_dim)


def test_qkv_split_reference_grouped_query():
    """Per group j its q query heads, its key, its value: query head j * q + i is row i of group j,
    key j row q, value j row q + 1; the bias gets the row sum of the packed gradients."""
    torch.manual_seed(8)
    seq, batch, groups, queries, head_dim = 3, 2, 2, 3, 4
    width = groups * (queries + 2) * head_dim
    mixed = torch.randn(seq, batch, width)
    bias = torch.randn(width, requires_grad=True)
    query, key, value = split_query_key_value_reference(mixed, bias, head_dim, queries)
    rows = mixed.view(seq, batch, groups, queries + 2, head_dim)
    for head in range(groups * queries):
        assert torch.equal(query[:, :, head], rows[:, :, head // queries, head % queries])
    for group in range(groups):
        assert torch.equal(key[:, :, group], rows[:, :, group, queries])
        assert torch.equal(value[:, :, group], rows[:, :, group, queries + 1])
    grads = torch.randn(seq, batch, groups * queries, head_dim), *torch.randn(2, seq, batch, groups, head_dim)
    torch.autograd.backward([query, key, value], list(grads))
    packed = torch.cat([grads[0].view(seq, batch, groups, queries, head_dim), grads[1][:, :, :, None],
                        grads[2][:, :, :, None]], dim=3)  # [s, b, g, q + 2, hn]
    torch.testing.assert_close(bias.grad, packed.sum((0, 1)).reshape(-1))


@pytest.mark.parametrize("clipped", [False, True])
def test_adamw_step_reference_steps_as_torchs_fused_adamw(clipped):
    """Three steps of the reference against torch's fused AdamW (its CPU kernel, which computes the
    moments in float64): within a few fp32 ulps of the largest value; the bf16 copy is the rounding."""
    torch.manual_seed(3)
    param = torch.randn(1001)
    grads = [torch.randn(1001) * scale for scale in (1.0, 1e-3, 30.0)]
    grad_scale = torch.tensor(2.5) if clipped else None
    expected = torch.nn.Parameter(param.clone())
    optimizer = torch.optim.AdamW([expected], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    ours, exp_avg, exp_avg_sq, step = param.clone(), torch.zeros(1001), torch.zeros(1001), torch.zeros(())
    copy = torch.empty(1001, dtype=torch.bfloat16)
    for grad in grads:
        expected.grad = grad.clone()
        optimizer.grad_scale = grad_scale
        optimizer.step()
        step += 1
        adamw_step_reference(ours, grad, exp_avg, exp_avg_sq, step, lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                             weight_decay=0.1, grad_scale=grad_scale, param_copy=copy)
    state = optimizer.state[expected]
    ulps = 8 * torch.finfo(torch.float32).eps
    for got, want in ((ours, expected.detach()), (exp_avg, state["exp_avg"]), (exp_avg_sq, state["exp_avg_sq"])):
        torch.testing.assert_close(got, want, rtol=ulps, atol=ulps * want.abs().max().item())
    assert torch.equal(copy, ours.bfloat16()) and not torch.equal(ours, param)
