"""The fused ops of a training step, each the Triton kernel (forward and backward) or its reference.

Each op checks its arguments (FusedKernelArgumentError), then ``selection.fused_or_reference`` picks
the kernel when the rules of ``selection`` and the kernel's own constraints hold
(``*_constraint_violation`` below: floating dtypes fp16/bf16/fp32, rows short enough to sit in
registers, int32-indexable element counts). Inputs that are not contiguous are copied to contiguous
ones for the kernels.
"""
import torch

from megatron.core.fused_kernels import reference
from megatron.core.fused_kernels.selection import (FusedKernelArgumentError, check_hidden_vector, dtype_violation,
                                                   fused_or_reference)

MAX_SOFTMAX_KEYS = 16384  # a whole row of fp32 scores per program, in registers
MAX_LAYER_NORM_HIDDEN = 16384  # likewise for a row of layer-norm input
MAX_ELEMENTWISE_NUMEL = 2**31 - 1  # flat indices (and dropout's Philox offsets) are int32


def softmax_constraint_violation(scores, mask):
    """Why the Triton softmax cannot take these inputs on any device, or None."""
    if scores.shape[-1] > MAX_SOFTMAX_KEYS:
        return f"sk = {scores.shape[-1]} keys > {MAX_SOFTMAX_KEYS}"
    if scores.numel() == 0:
        return "scores are empty"
    return dtype_violation("scores", scores)


def layer_norm_constraint_violation(x, weight, bias):
    """Why the Triton layer norm cannot take these inputs on any device, or None."""
    return _norm_violation(x, (("weight", weight), ("bias", bias)))


def rms_norm_constraint_violation(x, weight):
    """Why the Triton RMSNorm cannot take these inputs on any device, or None."""
    return _norm_violation(x, (("weight", weight),))


def _norm_violation(x, parameters):
    """Shared rules of the norms: a row of x fits in registers, floating dtypes (each its own)."""
    if x.shape[-1] > MAX_LAYER_NORM_HIDDEN:
        return f"hidden size {x.shape[-1]} > {MAX_LAYER_NORM_HIDDEN}"
    if x.numel() == 0:
        return "x is empty"
    for name, tensor in (("x", x), *parameters):
        violation = dtype_violation(name, tensor)
        if violation:
            return violation
    return None


def _elementwise_violation(x, others):
    """Shared rules of bias_gelu, bias_dropout_add and split_query_key_value: x's dtype, the others'
    equal to it, sizes."""
    if x.numel() == 0 or x.numel() > MAX_ELEMENTWISE_NUMEL:
        return f"{x.numel()} elements, the kernel takes 1 to {MAX_ELEMENTWISE_NUMEL}"
    violation = dtype_violation("the input", x)
    if violation:
        return violation
    for name, tensor in others:
        if tensor is not None and tensor.dtype != x.dtype:
            return f"{name} has dtype {tensor.dtype} != {x.dtype} (torch would promote the result)"
    return None


def bias_gelu_constraint_violation(bias, y):
    """Why the Triton bias-GeLU cannot take these inputs on any device, or None."""
    return _elementwise_violation(y, (("bias", bias),))


def bias_dropout_add_constraint_violation(x, bias, residual, prob):
    """Why the Triton bias-dropout-add cannot take these inputs on any device, or None."""
    if prob >= 1.0:
        return "prob = 1 drops everything (the reference returns the residual)"
    return _elementwise_violation(x, (("bias", bias), ("residual", residual)))


def qkv_split_constraint_violation(mixed, bias, head_dim, queries_per_group=1):
    """Why the Triton split (its backward) cannot take these inputs on any device, or None."""
    row = (queries_per_group + 2) * head_dim
    if mixed.dim() != 3 or mixed.shape[-1] % row != 0:
        return f"mixed {tuple(mixed.shape)} is not [s, b, groups * {queries_per_group + 2} * {head_dim}]"
    return _elementwise_violation(mixed, (("bias", bias),))


def adamw_constraint_violation(param, grad, exp_avg, exp_avg_sq, param_copy):
    """Why the Triton AdamW step cannot take these tensors on any device, or None (flat indexing)."""
    tensors = (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq),
               ("param_copy", param_copy))
    for name, tensor in tensors:
        if tensor is not None and not tensor.is_contiguous():
            return f"{name} is not contiguous"
    if param.numel() == 0:
        return "param is empty"
    return None if param_copy is None else dtype_violation("param_copy", param_copy)


def cross_entropy_constraint_violation(logits):
    """Why the Triton cross entropy (tensor_parallel.cross_entropy) cannot take these logits, or None."""
    return dtype_violation("logits", logits)


def _broadcasts_to(shape, target):
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def scale_mask_softmax(scores, mask, scale, causal, softmax_in_fp32):
    """probs = softmax(scale * scores, masked keys excluded) over the last dim.

    scores: [b, np, sq, sk]; mask: bool tensor broadcastable to scores, True = masked out, or
    None; ``causal`` also masks keys after each query (queries are the last sq of sk positions,
    Megatron's ScaledUpperTriangMaskedSoftmax when sq == sk). Masked keys get probability 0; a
    fully masked row is uniform. Returns probs in the scores' dtype. ``softmax_in_fp32`` selects the
    reference's compute dtype; the fused kernel always computes in fp32.
    """
    if scores.dim() != 4:
        raise FusedKernelArgumentError(f"scale_mask_softmax: scores must be [b, np, sq, sk], got shape {tuple(scores.shape)}")
    if causal and scores.shape[-2] > scores.shape[-1]:
        raise FusedKernelArgumentError(f"scale_mask_softmax: causal needs sq <= sk, got scores {tuple(scores.shape)}")
    if mask is not None:
        if mask.dtype != torch.bool:
            raise FusedKernelArgumentError(f"scale_mask_softmax: mask must be a bool tensor (True = masked), got {mask.dtype}")
        if not _broadcasts_to(mask.shape, scores.shape):
            raise FusedKernelArgumentError(
                f"scale_mask_softmax: mask {tuple(mask.shape)} does not broadcast to scores {tuple(scores.shape)}"
            )
    return fused_or_reference(
        "triton_softmax", (scores, mask), lambda: softmax_constraint_violation(scores, mask),
        lambda kernels: kernels.ScaleMaskSoftmaxFunction.apply(scores, mask, scale, causal),
        lambda: reference.scale_mask_softmax_reference(scores, mask, scale, causal, softmax_in_fp32))


def layer_norm(x, weight, bias, eps, return_input=False):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim of x [..., h].

    weight, bias: [h]; statistics in fp32; y has x's dtype, gradients have their input's dtype.
    ``return_input``: return (y, x), x to be used again (a pre-LN block's residual); on the Triton
    path the gradient of that use is added to x's gradient inside the norm's backward kernel.
    """
    check_hidden_vector("layer_norm", "weight", weight, x.shape[-1])
    check_hidden_vector("layer_norm", "bias", bias, x.shape[-1])

    def unfused():
        y = reference.layer_norm_reference(x, weight, bias, eps)
        return (y, x) if return_input else y

    return fused_or_reference(
        "triton_layer_norm", (x, weight, bias), lambda: layer_norm_constraint_violation(x, weight, bias),
        lambda kernels: kernels.LayerNormFunction.apply(x, weight, bias, eps, return_input), unfused)


def rms_norm(x, weight, eps, return_input=False):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim of x [..., h]; weight [h].

    The mean in fp32; y has x's dtype, gradients have their input's dtype. ``return_input`` as in
    ``layer_norm``: return (y, x), and on the Triton path (triton_rms_norm) the residual's gradient is
    added to x's inside the norm's backward kernel.
    """
    check_hidden_vector("rms_norm", "weight", weight, x.shape[-1])
    if weight is None:
        raise FusedKernelArgumentError("rms_norm: weight must be a tensor of shape [h], got None")

    def unfused():
        y = reference.rms_norm_reference(x, weight, eps)
        return (y, x) if return_input else y

    return fused_or_reference(
        "triton_rms_norm", (x, weight), lambda: rms_norm_constraint_violation(x, weight),
        lambda kernels: kernels.RMSNormFunction.apply(x, weight, eps, return_input), unfused)


def bias_gelu(bias, y):
    """gelu_tanh(y + bias) for y [..., h], bias [h]: Megatron's fused bias_gelu (tanh approximation)."""
    check_hidden_vector("bias_gelu", "bias", bias, y.shape[-1])
    return fused_or_reference(
        "triton_elementwise", (bias, y), lambda: bias_gelu_constraint_violation(bias, y),
        lambda kernels: kernels.BiasGeluFunction.apply(bias, y), lambda: reference.bias_gelu_reference(bias, y))


def split_query_key_value(mixed, bias, head_dim, queries_per_group=1):
    """q [s, b, np, hn], k, v [s, b, g, hn] of the query_key_value projection's output mixed
    [s, b, g * (q + 2) * hn] (per key/value group: its q = ``queries_per_group`` query heads, its key,
    its value; q = 1 is multi-head attention, per head query, key, value rows, and the three are
    views; for q > 1 the query is a copy). ``bias`` [g * (q + 2) * hn] or None is the projection's
    bias, added into ``mixed`` without its gradient (ColumnParallelLinear's ``bias_grad_by_caller``):
    it gets the row sum of dmixed here. On CUDA one backward kernel packs dq, dk, dv into dmixed and
    takes that sum during the copy (triton_qkv_split)."""
    if bias is not None and tuple(bias.shape) != (mixed.shape[-1],):
        raise FusedKernelArgumentError(f"split_query_key_value: bias {tuple(bias.shape)} does not match mixed "
                                       f"{tuple(mixed.shape)}")
    if not isinstance(queries_per_group, int) or queries_per_group < 1:
        raise FusedKernelArgumentError(f"split_query_key_value: queries_per_group must be a positive int, got "
                                       f"{queries_per_group!r}")
    return fused_or_reference(
        "triton_qkv_split", (mixed, bias),
        lambda: qkv_split_constraint_violation(mixed, bias, head_dim, queries_per_group),
        lambda kernels: kernels.QueryKeyValueSplitFunction.apply(mixed, bias, head_dim, queries_per_group),
        lambda: reference.split_query_key_value_reference(mixed, bias, head_dim, queries_per_group))


def bias_dropout_add(x, bias, residual, prob, training):
    """residual + dropout(x + bias, prob) for x, residual [..., h] and bias [h] or None.

    Dropout (only when ``training``) keeps each element with probability 1 - prob and scales it by
    1 / (1 - prob); its randomness comes from torch's default generator of x's device, so
    restoring that generator's state reproduces the mask (activation checkpointing).
    """
    if tuple(x.shape) != tuple(residual.shape):
        raise FusedKernelArgumentError(f"bias_dropout_add: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    check_hidden_vector("bias_dropout_add", "bias", bias, x.shape[-1])
    if not 0.0 <= prob <= 1.0:
        raise FusedKernelArgumentError(f"bias_dropout_add: prob must be in [0, 1], got {prob}")
    return fused_or_reference(
        "triton_elementwise", (x, bias, residual),
        lambda: bias_dropout_add_constraint_violation(x, bias, residual, prob),
        lambda kernels: kernels.BiasDropoutAddFunction.apply(x, bias, residual, prob, training and prob > 0.0),
        lambda: reference.bias_dropout_add_reference(x, bias, residual, prob, training))


def adamw_step(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay,
               grad_scale=None, param_copy=None):
    """One AdamW step (decoupled weight decay) of ``param`` in place, torch.optim.AdamW(fused=True)'s math:

        g = grad / grad_scale                      (no division without a grad_scale)
        p <- p - lr * weight_decay * p
        m <- beta1 * m + (1 - beta1) * g           (exp_avg)
        v <- beta2 * v + (1 - beta2) * g^2         (exp_avg_sq)
        p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

    param, grad, exp_avg, exp_avg_sq: fp32 tensors of one shape; ``step``: a 0-dim tensor holding t,
    this step's count (already advanced), read on its device; ``grad_scale``: a 0-dim fp32 tensor or
    None. ``param_copy`` (param's shape, fp16/bf16/fp32) receives the new p in its dtype. ``grad``
    is left as it was. On CUDA one Triton kernel does it all (triton_adamw); else the reference.
    """
    for name, tensor in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("param_copy", param_copy)):
        if tensor is not None and tensor.shape != param.shape:
            raise FusedKernelArgumentError(f"adamw_step: {name} {tuple(tensor.shape)} != param {tuple(param.shape)}")
    for name, tensor in (("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if tensor.dtype != torch.float32:
            raise FusedKernelArgumentError(f"adamw_step: {name} must be fp32, got {tensor.dtype}")
    settings = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale,
                    param_copy=param_copy)
    return fused_or_reference(
        "triton_adamw", (param, grad, exp_avg, exp_avg_sq, step, grad_scale, param_copy),
        lambda: adamw_constraint_violation(param, grad, exp_avg, exp_avg_sq, param_copy),
        lambda kernels: kernels.adamw_step(param, grad, exp_avg, exp_avg_sq, step, **settings),
        lambda: reference.adamw_step_reference(param, grad, exp_avg, exp_avg_sq, step, **settings))
