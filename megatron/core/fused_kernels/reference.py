"""Plain-torch references of the fused kernels: the ground truth the fast versions are checked against.

Each function is written with ordinary torch operations, runs on any device and supports autograd
through torch itself. On CPU they are always the path taken; on GPU they are the fallback whenever a
fast kernel's constraints do not hold (see ``selection``).
"""
import functools

import torch
import torch.nn.functional as F


def _at_least_fp32(dtype):
    """fp32 for the half dtypes, the dtype itself for fp32 and float64."""
    return torch.promote_types(dtype, torch.float32)


def causal_mask(sq, sk=None, *, device=None):
    """Bool mask [sq, sk], True where key k is in the future of query q (so masked out).

    The one causal mask of the code base (the model's attention masks build on it too). Queries are
    the last ``sq`` positions of a ``sk``-long sequence (bottom-right alignment; ``sk`` defaults to
    ``sq``): query q sits at absolute position ``sk - sq + q`` and sees keys ``k <= sk - sq + q``. For
    ``sq == sk`` this is the upper triangle above the diagonal, Megatron's ``ScaledUpperTriangMaskedSoftmax``.
    """
    sk = sq if sk is None else sk
    if sq > sk:
        raise ValueError(f"causal softmax needs sq <= sk (queries are the last sq of sk positions); got sq={sq}, sk={sk}")
    query_position = torch.arange(sk - sq, sk, device=device)[:, None]  # [sq, 1]
    key_position = torch.arange(sk, device=device)[None, :]  # [1, sk]
    return key_position > query_position


def scale_mask_softmax_reference(scores, mask, scale, causal, softmax_in_fp32):
    """probs = softmax(fill(scale * scores, masked, finfo.min)) over the last dim.

    scores: [b, np, sq, sk]; mask: bool, broadcastable to scores, True = masked out (or None);
    causal adds ``causal_mask(sq, sk)``. Masked positions are filled with the smallest finite value
    of the compute dtype, so they get probability exactly 0 and a fully masked row comes out
    uniform (Megatron's ``attention_mask_func``). The softmax runs in (at least) fp32 when
    ``softmax_in_fp32``, else in the scores' dtype; probs have the scores' dtype.
    """
    x = scores.to(_at_least_fp32(scores.dtype)) if softmax_in_fp32 else scores
    x = x * scale
    if causal:
        x = x.masked_fill(causal_mask(x.shape[-2], x.shape[-1], device=x.device), torch.finfo(x.dtype).min)
    if mask is not None:
        x = x.masked_fill(mask, torch.finfo(x.dtype).min)
    return torch.softmax(x, dim=-1).to(scores.dtype)


def layer_norm_reference(x, weight, bias, eps):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim, statistics in fp32.

    x: [..., h]; weight, bias: [h]. var is the biased variance; computed in (at least) fp32 whatever
    the dtypes of x and weight; y has x's dtype.
    """
    compute_dtype = _at_least_fp32(x.dtype)
    y = F.layer_norm(x.to(compute_dtype), (x.shape[-1],), weight.to(compute_dtype), bias.to(compute_dtype), eps)
    return y.to(x.dtype)


def rms_norm_reference(x, weight, eps):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim, the mean in fp32.

    x: [..., h]; weight: [h]. Computed in (at least) fp32 whatever the dtypes of x and weight; y has
    x's dtype. No mean is subtracted and there is no bias (Zhang & Sennrich's RMSNorm, as in Llama).
    """
    compute_dtype = _at_least_fp32(x.dtype)
    x32 = x.to(compute_dtype)
    y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.to(compute_dtype)
    return y.to(x.dtype)


def bias_gelu_reference(bias, y):
    """gelu_tanh(y + bias) = 0.5 t (1 + tanh(sqrt(2/pi) (t + 0.044715 t^3))), t = y + bias.

    The tanh approximation of GeLU used by Megatron's fused bias_gelu (HF "gelu_new").
    y: [..., h]; bias: [h].
    """
    return F.gelu(y + bias, approximate="tanh")


def bias_dropout_add_reference(x, bias, residual, prob, training):
    """residual + dropout(x + bias, prob): kept elements are scaled by 1 / (1 - prob).

    x, residual: same shape [..., h]; bias: [h] or None. Without ``training`` dropout is the
    identity. The dropout mask comes from torch's default generator of x's device.
    """
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=prob, training=training)


class _BiasAlreadyAdded(torch.autograd.Function):
    """y unchanged; backward gives ``bias`` (added into y by its producer, outside autograd) the
    gradient sum_t dy[t] over every row of y [..., n]."""

    @staticmethod
    def forward(ctx, y, bias):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad_y):
        return grad_y, grad_y.reshape(-1, grad_y.shape[-1]).sum(0)


def split_query_key_value_reference(mixed, bias, head_dim, queries_per_group=1):
    """q [s, b, np, hn] and k, v [s, b, g, hn] of the query_key_value projection's output mixed
    [s, b, g * (q + 2) * hn], q = ``queries_per_group`` = np / g: per key/value group its q query
    heads, then its key, then its value ([g, q + 2, hn]; with q = 1 the per-head [np, 3, hn] of
    multi-head attention, and the three are views). ``bias`` [g * (q + 2) * hn] or None: the
    projection's bias, already in ``mixed`` but not differentiated there; it receives the row sum of
    dmixed."""
    if bias is not None:
        mixed = _BiasAlreadyAdded.apply(mixed, bias)
    seq, batch = mixed.shape[:2]
    if queries_per_group == 1:
        return mixed.view(seq, batch, -1, 3 * head_dim).split(head_dim, dim=-1)
    grouped = mixed.view(seq, batch, -1, queries_per_group + 2, head_dim)  # [s, b, g, q + 2, hn]
    query = grouped[:, :, :, :queries_per_group].reshape(seq, batch, -1, head_dim)
    return query, grouped[:, :, :, queries_per_group], grouped[:, :, :, queries_per_group + 1]


def decode_attention_reference(query, keys, values, position, slopes, scale, new_key=None, new_value=None):
    """softmax(scale q K^T + B) V for one query per row and head at position p of a fixed-size cache.

    query: [b, np, 1, hn]; keys, values: [b, g, T, hn], g key/value groups dividing np (g = np:
    multi-head attention), query head j reading group j // (np / g); positions 0 .. p count (the
    later ones are excluded); position: a one-element int64 tensor holding p; B = m_j (t - p) for
    the ALiBi slopes m [np], or 0 when ``slopes`` is None. new_key, new_value [b, g, 1, hn] or None:
    written into keys and values at p first. Returns [b, np, 1, hn] in the query's dtype.
    """
    if new_key is not None:
        keys.index_copy_(2, position.reshape(1), new_key)
        values.index_copy_(2, position.reshape(1), new_value)
    key_positions = torch.arange(keys.shape[-2], device=keys.device)[None, :]  # [1, T]: one query
    hidden = key_positions > position
    if slopes is None:
        bias = ~hidden
    else:
        distance = (key_positions - position).to(torch.float32)
        bias = (slopes.to(torch.float32)[:, None, None] * distance).to(query.dtype).masked_fill(hidden, float("-inf"))
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=bias, scale=scale,
                                          enable_gqa=keys.shape[1] != query.shape[1])


def swiglu(y):
    """a * silu(g) for y = [a | g] [..., 2n] (a the first n columns, g the last n): SwiGLU's gate, as
    the model's MLP applies it to its first matrix product."""
    linear, gate = y.chunk(2, dim=-1)
    return linear * F.silu(gate)


# the decode ops' activations by name: None, GeLU's tanh form or its erf form, SwiGLU (halves the width)
ACTIVATIONS = {None: None, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "gelu": F.gelu,
               "swiglu": swiglu}
NORMS = ("layer", "rms")  # layer_norm_linear's norms: LayerNorm, RMSNorm


def linear_reference(x, weight, bias, residual):
    """r + (x W^T + b): x [..., K], weight [N, K], bias [N] or None, residual [..., N]; the product
    rounded to x's dtype before the adds, as the separate bias-add kernel sees it."""
    y = F.linear(x, weight)
    if bias is not None:
        y = y + bias
    return residual + y


def layer_norm_linear_reference(x, norm_weight, norm_bias, eps, weight, bias, activation, norm="layer"):
    """act(N(x) W^T + b) for x [..., K]: the norm N (``norm`` "layer": ``layer_norm_reference`` with
    norm_bias; "rms": ``rms_norm_reference``, norm_bias None) rounded to x's dtype, then the product
    (with the bias inside F.linear when there is no activation, else added to the rounded product),
    then act (``ACTIVATIONS``: None, GeLU's tanh form, its erf form, or "swiglu", which maps the
    2N columns [a | g] to a * silu(g), N columns)."""
    normed = layer_norm_reference(x, norm_weight, norm_bias, eps) if norm == "layer" else \
        rms_norm_reference(x, norm_weight, eps)
    if activation is None:
        return F.linear(normed, weight, bias)
    y = F.linear(normed, weight)
    return ACTIVATIONS[activation](y if bias is None else y + bias)


def adamw_bias_corrections(step, lr, beta1, beta2):
    """[lr / (1 - beta1^t), sqrt(1 - beta2^t)] in fp32 on ``step``'s device, computed in float64
    from the step count t (a 0-dim tensor, read there: no wait for the host)."""
    t = step.double()
    return torch.stack([lr / (1 - beta1 ** t), (1 - beta2 ** t).sqrt()]).float()


def adamw_step_reference(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay,
                         grad_scale=None, param_copy=None):
    """``training_ops.adamw_step`` in torch operations, in place (temporaries of param's size)."""
    step_size, bias_correction2_sqrt = adamw_bias_corrections(step, lr, beta1, beta2)
    if grad_scale is not None:
        grad = grad / grad_scale
    param.sub_(param * (lr * weight_decay))
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    param.sub_(step_size * exp_avg / (exp_avg_sq.sqrt() / bias_correction2_sqrt + eps))
    if param_copy is not None:
        param_copy.copy_(param)
