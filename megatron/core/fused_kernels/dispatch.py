"""The public fused ops: each call takes the Triton kernel or the plain-torch reference.

The fast kernel runs when all of these hold, else the reference (same math, same dtypes out):

- fused kernels are enabled: ``set_fused_kernels_enabled(True/False)`` overrides the environment
  variable ``MEGATRON_FUSED_KERNELS`` (``0``/``false``/``off`` disables; default on);
- every input tensor is on one CUDA device (CPU always runs the reference);
- the call is not being traced by ``torch.compile`` (inductor fuses the reference by itself);
- triton can be imported (if not, one warning saying what to install, then references);
- the kernel's own constraints (``*_constraint_violation`` below): floating dtypes fp16/bf16/fp32,
  rows short enough to sit in registers, int32-indexable element counts.

Inputs that are not contiguous are copied to contiguous ones for the kernels.

The kernels of a one-token decoding step, ``linear`` and ``layer_norm_linear`` (one row of input)
and ``decode_attention``, also run under torch.compile: the decoding step is compiled and then
replayed from a CUDA graph (text_generation), and inductor would otherwise put cuBLAS's GEMM and a
masked attention over the whole cache there. They are registered as custom ops (``megatron::gemv``,
``megatron::decode_attention``, ``megatron::decode_attention_write``, which writes the cache),
which inductor calls as they are.
"""
import importlib
import os
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.fused_kernels import reference

ENV_VAR = "MEGATRON_FUSED_KERNELS"
FAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SOFTMAX_KEYS = 16384  # a whole row of fp32 scores per program, in registers
MAX_LAYER_NORM_HIDDEN = 16384  # likewise for a row of layer-norm input
MAX_ELEMENTWISE_NUMEL = 2**31 - 1  # flat indices (and dropout's Philox offsets) are int32

_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")
_enabled_override = None
_kernel_modules = {}


class FusedKernelArgumentError(ValueError):
    """A fused op (or MEGATRON_FUSED_KERNELS) got a value it cannot take; the message says which."""


def set_fused_kernels_enabled(enabled):
    """Use the fast kernels where they apply (True), never (False), or as the environment says (None)."""
    global _enabled_override
    if enabled is not None and not isinstance(enabled, bool):
        raise FusedKernelArgumentError(f"set_fused_kernels_enabled takes True, False or None, got {enabled!r}")
    _enabled_override = enabled


def fused_kernels_enabled():
    """Whether fast kernels may run: the override of set_fused_kernels_enabled, else MEGATRON_FUSED_KERNELS."""
    if _enabled_override is not None:
        return _enabled_override
    value = os.environ.get(ENV_VAR, "1").strip().lower()
    if value in _TRUE_WORDS:
        return True
    if value in _FALSE_WORDS:
        return False
    raise FusedKernelArgumentError(
        f"environment variable {ENV_VAR}={value!r}: expected one of {_TRUE_WORDS + _FALSE_WORDS}"
    )


def runtime_blocker(*tensors):
    """Why no fast kernel may run on ``tensors`` now (compiling, disabled, not CUDA), or None.

    The compiling case comes first, so that torch.compile traces no more of this than the check."""
    if torch.compiler.is_compiling():
        return "traced by torch.compile, which fuses the reference itself"
    if not fused_kernels_enabled():
        return f"fused kernels disabled ({ENV_VAR}=0 or set_fused_kernels_enabled(False))"
    return _device_blocker(tensors)


def _device_blocker(tensors):
    """Why ``tensors`` cannot go to a kernel by where they live (not CUDA, several devices), or None."""
    if not all(t.is_cuda for t in tensors):
        return "inputs are not all CUDA tensors"
    if len({t.device for t in tensors}) > 1:
        return "inputs are on different devices"
    return None


def _dtype_violation(name, tensor):
    if tensor.dtype not in FAST_DTYPES:
        return f"{name} has dtype {tensor.dtype}, the kernel takes {FAST_DTYPES}"
    return None


def softmax_constraint_violation(scores, mask):
    """Why the Triton softmax cannot take these inputs on any device, or None."""
    if scores.shape[-1] > MAX_SOFTMAX_KEYS:
        return f"sk = {scores.shape[-1]} keys > {MAX_SOFTMAX_KEYS}"
    if scores.numel() == 0:
        return "scores are empty"
    return _dtype_violation("scores", scores)


def layer_norm_constraint_violation(x, weight, bias):
    """Why the Triton layer norm cannot take these inputs on any device, or None."""
    if x.shape[-1] > MAX_LAYER_NORM_HIDDEN:
        return f"hidden size {x.shape[-1]} > {MAX_LAYER_NORM_HIDDEN}"
    if x.numel() == 0:
        return "x is empty"
    for name, tensor in (("x", x), ("weight", weight), ("bias", bias)):
        violation = _dtype_violation(name, tensor)
        if violation:
            return violation
    return None


def _elementwise_violation(x, others):
    """Shared rules of bias_gelu, bias_dropout_add and split_query_key_value: x's dtype, the others'
    equal to it, sizes."""
    if x.numel() == 0 or x.numel() > MAX_ELEMENTWISE_NUMEL:
        return f"{x.numel()} elements, the kernel takes 1 to {MAX_ELEMENTWISE_NUMEL}"
    violation = _dtype_violation("the input", x)
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


def split_query_key_value_constraint_violation(mixed, bias, head_dim):
    """Why the Triton split (its backward) cannot take these inputs on any device, or None."""
    if mixed.dim() != 3 or mixed.shape[-1] % (3 * head_dim) != 0:
        return f"mixed {tuple(mixed.shape)} is not [s, b, heads * 3 * {head_dim}]"
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
    return None if param_copy is None else _dtype_violation("param_copy", param_copy)


def cross_entropy_constraint_violation(logits):
    """Why the Triton cross entropy (tensor_parallel.cross_entropy) cannot take these logits, or None."""
    return _dtype_violation("logits", logits)


def kernel_module(module_name):
    """The Triton module ``fused_kernels.<module_name>``, or None (after one warning) without triton."""
    if module_name not in _kernel_modules:
        try:
            _kernel_modules[module_name] = importlib.import_module(f"megatron.core.fused_kernels.{module_name}")
        except ImportError as error:
            warnings.warn(f"fused kernels: {_import_problem(module_name, error)}; using the torch references")
            _kernel_modules[module_name] = None
    return _kernel_modules[module_name]


def _import_problem(module_name, error):
    """Why the Triton module could not be imported, with what to install when triton is missing."""
    if isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] == "triton":
        return ("triton is not installed (torch's CUDA builds ship it; otherwise `pip install triton`, "
                "the package's [triton] extra)")
    return f"{module_name} failed to import ({error})"


def _broadcasts_to(shape, target):
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def _check_hidden_vector(op, name, vector, hidden):
    if vector is not None and tuple(vector.shape) != (hidden,):
        raise FusedKernelArgumentError(f"{op}: {name} must have shape [{hidden}] (the last dim), got {tuple(vector.shape)}")


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
    tensors = (scores,) if mask is None else (scores, mask)
    if runtime_blocker(*tensors) is None and softmax_constraint_violation(scores, mask) is None:
        kernels = kernel_module("triton_softmax")
        if kernels is not None:
            return kernels.ScaleMaskSoftmaxFunction.apply(scores, mask, scale, causal)
    return reference.scale_mask_softmax_reference(scores, mask, scale, causal, softmax_in_fp32)


def layer_norm(x, weight, bias, eps, return_input=False):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the last dim of x [..., h].

    weight, bias: [h]; statistics in fp32; y has x's dtype, gradients have their input's dtype.
    ``return_input``: return (y, x), x to be used again (a pre-LN block's residual); on the Triton
    path the gradient of that use is added to x's gradient inside the norm's backward kernel.
    """
    _check_hidden_vector("layer_norm", "weight", weight, x.shape[-1])
    _check_hidden_vector("layer_norm", "bias", bias, x.shape[-1])
    if runtime_blocker(x, weight, bias) is None and layer_norm_constraint_violation(x, weight, bias) is None:
        kernels = kernel_module("triton_layer_norm")
        if kernels is not None:
            return kernels.LayerNormFunction.apply(x, weight, bias, eps, return_input)
    y = reference.layer_norm_reference(x, weight, bias, eps)
    return (y, x) if return_input else y


def bias_gelu(bias, y):
    """gelu_tanh(y + bias) for y [..., h], bias [h]: Megatron's fused bias_gelu (tanh approximation)."""
    _check_hidden_vector("bias_gelu", "bias", bias, y.shape[-1])
    if runtime_blocker(bias, y) is None and bias_gelu_constraint_violation(bias, y) is None:
        kernels = kernel_module("triton_elementwise")
        if kernels is not None:
            return kernels.BiasGeluFunction.apply(bias, y)
    return reference.bias_gelu_reference(bias, y)


def split_query_key_value(mixed, bias, head_dim):
    """q, k, v [s, b, np, hn] as views of the query_key_value projection's output mixed
    [s, b, np * 3 * hn] (per head: query, key, value rows). ``bias`` [np * 3 * hn] or None is the
    projection's bias, added into ``mixed`` without its gradient (ColumnParallelLinear's
    ``bias_grad_by_caller``): it gets the row sum of dmixed here. On CUDA one backward kernel packs
    dq, dk, dv into dmixed and takes that sum during the copy (triton_qkv_split)."""
    if bias is not None and tuple(bias.shape) != (mixed.shape[-1],):
        raise FusedKernelArgumentError(f"split_query_key_value: bias {tuple(bias.shape)} does not match mixed "
                                       f"{tuple(mixed.shape)}")
    tensors = (mixed,) if bias is None else (mixed, bias)
    if runtime_blocker(*tensors) is None and split_query_key_value_constraint_violation(mixed, bias, head_dim) is None:
        kernels = kernel_module("triton_qkv_split")
        if kernels is not None:
            return kernels.QueryKeyValueSplitFunction.apply(mixed, bias, head_dim)
    return reference.split_query_key_value_reference(mixed, bias, head_dim)


def bias_dropout_add(x, bias, residual, prob, training):
    """residual + dropout(x + bias, prob) for x, residual [..., h] and bias [h] or None.

    Dropout (only when ``training``) keeps each element with probability 1 - prob and scales it by
    1 / (1 - prob); its randomness comes from torch's default generator of x's device, so
    restoring that generator's state reproduces the mask (activation checkpointing).
    """
    if tuple(x.shape) != tuple(residual.shape):
        raise FusedKernelArgumentError(f"bias_dropout_add: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    _check_hidden_vector("bias_dropout_add", "bias", bias, x.shape[-1])
    if not 0.0 <= prob <= 1.0:
        raise FusedKernelArgumentError(f"bias_dropout_add: prob must be in [0, 1], got {prob}")
    tensors = (x, residual) if bias is None else (x, bias, residual)
    if runtime_blocker(*tensors) is None and bias_dropout_add_constraint_violation(x, bias, residual, prob) is None:
        kernels = kernel_module("triton_elementwise")
        if kernels is not None:
            return kernels.BiasDropoutAddFunction.apply(x, bias, residual, prob, training and prob > 0.0)
    return reference.bias_dropout_add_reference(x, bias, residual, prob, training)


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
    tensors = [t for t in (param, grad, exp_avg, exp_avg_sq, step, grad_scale, param_copy) if t is not None]
    if runtime_blocker(*tensors) is None and adamw_constraint_violation(param, grad, exp_avg, exp_avg_sq,
                                                                        param_copy) is None:
        kernels = kernel_module("triton_adamw")
        if kernels is not None:
            return kernels.adamw_step(param, grad, exp_avg, exp_avg_sq, step, lr=lr, beta1=beta1, beta2=beta2,
                                      eps=eps, weight_decay=weight_decay, grad_scale=grad_scale,
                                      param_copy=param_copy)
    return reference.adamw_step_reference(param, grad, exp_avg, exp_avg_sq, step, lr=lr, beta1=beta1, beta2=beta2,
                                          eps=eps, weight_decay=weight_decay, grad_scale=grad_scale,
                                          param_copy=param_copy)


@torch.library.custom_op("megatron::gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
             norm_weight: Optional[torch.Tensor], norm_bias: Optional[torch.Tensor], eps: float,
             activation: Optional[str]) -> torch.Tensor:
    norm = None if norm_weight is None else (norm_weight, norm_bias, eps)
    return kernel_module("triton_decode").gemv(x, weight, bias, residual, norm, activation)


@_gemv_op.register_fake
def _gemv_shape(x, weight, bias, residual, norm_weight, norm_bias, eps, activation):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("megatron::decode_attention", mutates_args=())
def _decode_attention_op(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
                         slopes: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    return kernel_module("triton_decode").decode_attention(query, keys, values, position, slopes, scale)


@_decode_attention_op.register_fake
def _decode_attention_shape(query, keys, values, position, slopes, scale):
    return query.new_empty(query.shape)


@torch.library.custom_op("megatron::decode_attention_write", mutates_args=("keys", "values"))
def _decode_attention_write_op(query: torch.Tensor, new_key: torch.Tensor, new_value: torch.Tensor,
                               keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
                               slopes: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    return kernel_module("triton_decode").decode_attention(query, keys, values, position, slopes, scale, new_key,
                                                           new_value)


@_decode_attention_write_op.register_fake
def _decode_attention_write_shape(query, new_key, new_value, keys, values, position, slopes, scale):
    return query.new_empty(query.shape)


# What torch.compiler.assume_constant_result sets on a function (tested against it): the decorator
# itself imports torch._dynamo, seconds at the start of every process that imports this module.
CONSTANT_RESULT_MARKER = "_dynamo_marked_constant"


def _decode_kernels_available():
    """Fused kernels enabled and triton importable: a constant for torch.compile, which traces the callers."""
    return fused_kernels_enabled() and kernel_module("triton_decode") is not None


setattr(_decode_kernels_available, CONSTANT_RESULT_MARKER, True)


def _needs_autograd(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _decode_inputs_fit(dtype, *tensors):
    """All given tensors CUDA, on one device, of one fast dtype, and no gradient wanted."""
    present = [t for t in tensors if t is not None]
    return (dtype in FAST_DTYPES and all(t.dtype == dtype for t in present) and _device_blocker(present) is None
            and not _needs_autograd(*present))


def _gemv_fits(x, weight, *vectors):
    """One row of x, a 2-d contiguous weight, contiguous optional vectors, all fit for a decode kernel."""
    return (x.numel() == x.shape[-1] > 0 and weight.dim() == 2 and weight.is_contiguous()
            and all(v is None or v.is_contiguous() for v in vectors)
            and _decode_inputs_fit(x.dtype, x, weight, *vectors) and _decode_kernels_available())


def linear(x, weight, bias=None, residual=None):
    """x W^T + b (+ r), as ``torch.nn.functional.linear``: x [..., K], weight [N, K], bias [N] or None,
    residual [..., N] or None (then round(x W^T) + b + r, as a separate add would compute it).

    A single row of input (a batch-1 decoding step) on CUDA, outside autograd, with a contiguous
    weight, bias and residual runs the Triton GEMV (triton_decode.gemv, fp32 accumulation); anything
    else ``reference.linear_reference``.
    """
    if residual is not None and residual.shape != (*x.shape[:-1], weight.shape[0]):
        raise FusedKernelArgumentError(f"linear: residual {tuple(residual.shape)} does not match the output "
                                       f"{(*x.shape[:-1], weight.shape[0])}")
    if _gemv_fits(x, weight, bias, residual):
        return torch.ops.megatron.gemv(x, weight, bias, residual, None, None, 0.0, None)
    if residual is None:
        return F.linear(x, weight, bias)
    return reference.linear_reference(x, weight, bias, residual)


def layer_norm_linear(x, norm_weight, norm_bias, eps, weight, bias=None, activation=None):
    """act(LN(x) W^T + b): ``layer_norm`` then ``linear``, then act (None, "gelu_tanh" or "gelu", the
    erf form) of the sum with the bias; x [..., K], norm_weight and norm_bias [K], weight [N, K].

    One row on CUDA (the rules of ``linear``) runs the GEMV with the layer norm in its prologue and
    the activation in its epilogue; anything else ``reference.layer_norm_linear_reference``.
    """
    if activation not in reference.ACTIVATIONS:
        raise FusedKernelArgumentError(f"layer_norm_linear: activation must be one of "
                                       f"{sorted(reference.ACTIVATIONS, key=str)}, got {activation!r}")
    _check_hidden_vector("layer_norm_linear", "norm_weight", norm_weight, x.shape[-1])
    _check_hidden_vector("layer_norm_linear", "norm_bias", norm_bias, x.shape[-1])
    if _gemv_fits(x, weight, bias, norm_weight, norm_bias):
        return torch.ops.megatron.gemv(x, weight, bias, None, norm_weight, norm_bias, eps, activation)
    return reference.layer_norm_linear_reference(x, norm_weight, norm_bias, eps, weight, bias, activation)


def decode_attention(query, keys, values, position, slopes, scale, new_key=None, new_value=None):
    """One query per row and head at position p of a fixed-size key/value cache (see
    ``reference.decode_attention_reference`` for the math and shapes; given new_key and new_value,
    the step's own [b, np, 1, hn], they are first written into the cache at p): the Triton kernel on
    CUDA for fp16/bf16/fp32 with contiguous caches, which reads only positions 0 .. p; else the reference."""
    if query.dim() != 4 or query.shape[-2] != 1 or keys.shape != values.shape or keys.shape[:2] != query.shape[:2] \
            or keys.shape[-1] != query.shape[-1]:
        raise FusedKernelArgumentError(f"decode_attention: query must be [b, np, 1, hn] and keys, values "
                                       f"[b, np, T, hn], got {tuple(query.shape)}, {tuple(keys.shape)}, "
                                       f"{tuple(values.shape)}")
    if position.numel() != 1 or position.dtype != torch.long:
        raise FusedKernelArgumentError(f"decode_attention: position must be one int64 element, got "
                                       f"{position.dtype} of shape {tuple(position.shape)}")
    if (new_key is None) != (new_value is None) or new_key is not None and not (
            new_key.shape == new_value.shape == query.shape and new_key.dtype == new_value.dtype == keys.dtype):
        raise FusedKernelArgumentError("decode_attention: new_key and new_value come together, shaped as the "
                                       "query and of the cache's dtype")
    if (keys.is_contiguous() and values.is_contiguous() and query.stride(-1) == 1 and position.is_cuda
            and (slopes is None or slopes.is_cuda and slopes.is_contiguous())
            and (new_key is None or new_key.stride() == new_value.stride() and new_key.stride(-1) == 1)
            and _decode_inputs_fit(query.dtype, query, keys, values, new_key, new_value)
            and _decode_kernels_available()):
        if new_key is None:
            return torch.ops.megatron.decode_attention(query, keys, values, position, slopes, scale)
        return torch.ops.megatron.decode_attention_write(query, new_key, new_value, keys, values, position, slopes,
                                                         scale)
    return reference.decode_attention_reference(query, keys, values, position, slopes, scale, new_key, new_value)
