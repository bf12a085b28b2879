"""The fused ops of a one-token decoding step: ``linear`` and ``layer_norm_linear`` (one row of input,
with a LayerNorm or RMSNorm, an activation (GeLU, SwiGLU) or a residual folded in) and ``decode_attention``, forward only.

Unlike the training ops they also run under torch.compile: the decoding step is compiled and then
replayed from a CUDA graph (text_generation), and inductor would otherwise put cuBLAS's GEMM and a
masked attention over the whole cache there. They are registered as custom ops (``megatron::gemv``,
``megatron::decode_attention``, ``megatron::decode_attention_write``, which writes the cache),
which inductor calls as they are. The kernels run when the inputs fit (CUDA, one fast dtype, no
gradient wanted, the shapes each op names), fused kernels are enabled and triton imports
(``selection``); anything else runs the reference.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.fused_kernels import reference
from megatron.core.fused_kernels.elementwise_ops import rotary_embedding_reference
from megatron.core.fused_kernels.selection import (FAST_DTYPES, FusedKernelArgumentError, check_hidden_vector,
                                                   device_blocker, fused_kernels_enabled, kernel_module)


@torch.library.custom_op("megatron::gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
             norm_weight: Optional[torch.Tensor], norm_bias: Optional[torch.Tensor], eps: float, norm: str,
             activation: Optional[str]) -> torch.Tensor:
    normalization = None if norm_weight is None else (norm, norm_weight, norm_bias, eps)
    return kernel_module("triton_decode").gemv(x, weight, bias, residual, normalization, activation)


@_gemv_op.register_fake
def _gemv_shape(x, weight, bias, residual, norm_weight, norm_bias, eps, norm, activation):
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2 if activation == "swiglu" else weight.shape[0]))


def _attention_output_shape(query):
    """[b, np, 1, hn] of a query [b, np, 1, hn] or [b, g, q, 1, hn]."""
    return (query.shape[0], query.shape[1] * query.shape[2], 1, query.shape[-1]) if query.dim() == 5 else query.shape


@torch.library.custom_op("megatron::decode_attention", mutates_args=())
def _decode_attention_op(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
                         slopes: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    return kernel_module("triton_decode").decode_attention(query, keys, values, position, slopes, scale)


@_decode_attention_op.register_fake
def _decode_attention_shape(query, keys, values, position, slopes, scale):
    return query.new_empty(_attention_output_shape(query))


@torch.library.custom_op("megatron::decode_attention_write", mutates_args=("keys", "values"))
def _decode_attention_write_op(query: torch.Tensor, new_key: torch.Tensor, new_value: torch.Tensor,
                               keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
                               slopes: Optional[torch.Tensor], scale: float, inv_freq: Optional[torch.Tensor],
                               rotary_positions: Optional[torch.Tensor]) -> torch.Tensor:
    return kernel_module("triton_decode").decode_attention(query, keys, values, position, slopes, scale, new_key,
                                                           new_value, inv_freq, rotary_positions)


@_decode_attention_write_op.register_fake
def _decode_attention_write_shape(query, new_key, new_value, keys, values, position, slopes, scale, inv_freq,
                                  rotary_positions):
    return query.new_empty(_attention_output_shape(query))


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
    return (dtype in FAST_DTYPES and all(t.dtype == dtype for t in present) and device_blocker(present) is None
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
        return torch.ops.megatron.gemv(x, weight, bias, residual, None, None, 0.0, "layer", None)
    if residual is None:
        return F.linear(x, weight, bias)
    return reference.linear_reference(x, weight, bias, residual)


def layer_norm_linear(x, norm_weight, norm_bias, eps, weight, bias=None, activation=None, norm="layer"):
    """act(N(x) W^T + b): a norm, then ``linear``, then act of the sum with the bias; x [..., K],
    norm_weight [K], weight [N, K], bias [N] or None.

    ``norm``: "layer", LayerNorm with norm_bias [K]; "rms", RMSNorm x / sqrt(mean(x^2) + eps) *
    norm_weight, norm_bias None. ``activation``: None, "gelu_tanh", "gelu" (the erf form), or
    "swiglu": weight [2n, K] (and bias [2n]) hold the rows of a, then those of g, and the output
    [..., n] is a * silu(g), the gated MLP's first half (the model's per-rank [W_a; W_g] layout).
    One row on CUDA (the rules of ``linear``) runs the GEMV with the norm in its prologue and the
    activation in its epilogue; anything else ``reference.layer_norm_linear_reference``.
    """
    if activation not in reference.ACTIVATIONS:
        raise FusedKernelArgumentError(f"layer_norm_linear: activation must be one of "
                                       f"{sorted(reference.ACTIVATIONS, key=str)}, got {activation!r}")
    if norm not in reference.NORMS:
        raise FusedKernelArgumentError(f"layer_norm_linear: norm must be one of {sorted(reference.NORMS)}, "
                                       f"got {norm!r}")
    if (norm_bias is None) != (norm == "rms"):
        raise FusedKernelArgumentError(f"layer_norm_linear: norm {norm!r} takes "
                                       f"{'no norm_bias' if norm == 'rms' else 'a norm_bias [K]'}")
    if activation == "swiglu" and weight.shape[0] % 2:
        raise FusedKernelArgumentError(f"layer_norm_linear: swiglu needs an even number of weight rows ([a; g]), "
                                       f"got weight {tuple(weight.shape)}")
    check_hidden_vector("layer_norm_linear", "norm_weight", norm_weight, x.shape[-1])
    check_hidden_vector("layer_norm_linear", "norm_bias", norm_bias, x.shape[-1])
    check_hidden_vector("layer_norm_linear", "bias", bias, weight.shape[0])
    if _gemv_fits(x, weight, bias, norm_weight, norm_bias):
        return torch.ops.megatron.gemv(x, weight, bias, None, norm_weight, norm_bias, eps, norm, activation)
    return reference.layer_norm_linear_reference(x, norm_weight, norm_bias, eps, weight, bias, activation, norm)


def _check_decode_attention_arguments(query, keys, values, position, new_key, new_value, rotary):
    heads = _attention_output_shape(query)[1] if query.dim() in (4, 5) else 0
    if query.dim() not in (4, 5) or query.shape[-2] != 1 or keys.dim() != 4 or keys.shape != values.shape \
            or keys.shape[0] != query.shape[0] or heads % keys.shape[1] != 0 or keys.shape[-1] != query.shape[-1] \
            or query.dim() == 5 and query.shape[1] != keys.shape[1]:
        raise FusedKernelArgumentError(f"decode_attention: query must be [b, np, 1, hn] or [b, g, np / g, 1, hn] and "
                                       f"keys, values [b, g, T, hn] with g dividing np, got {tuple(query.shape)}, "
                                       f"{tuple(keys.shape)}, {tuple(values.shape)}")
    if position.numel() != 1 or position.dtype != torch.long:
        raise FusedKernelArgumentError(f"decode_attention: position must be one int64 element, got "
                                       f"{position.dtype} of shape {tuple(position.shape)}")
    step_shape = (*keys.shape[:2], 1, keys.shape[-1])
    if (new_key is None) != (new_value is None) or new_key is not None and not (
            new_key.shape == new_value.shape == step_shape and new_key.dtype == new_value.dtype == keys.dtype):
        raise FusedKernelArgumentError(f"decode_attention: new_key and new_value come together, shaped "
                                       f"{step_shape} ([b, g, 1, hn]) and of the cache's dtype")
    if rotary is not None:
        inv_freq, positions = rotary
        if new_key is None or inv_freq.dtype != torch.float32 or inv_freq.dim() != 1 \
                or not 0 < 2 * inv_freq.numel() <= keys.shape[-1] or positions.numel() not in (1, keys.shape[0]) \
                or positions.dtype.is_floating_point or positions.dtype == torch.bool:
            raise FusedKernelArgumentError(f"decode_attention: rotary = (inv_freq [d / 2] fp32 with d <= hn, "
                                           f"positions of b or 1 integers) needs new_key; got inv_freq "
                                           f"{inv_freq.dtype} {tuple(inv_freq.shape)}, positions {positions.dtype} "
                                           f"{tuple(positions.shape)}")


def _rotated_reference(query, new_key, rotary):
    """query [b, np, 1, hn] and new_key [b, g, 1, hn] turned by the rotary embedding (the reference)."""
    inv_freq, positions = rotary
    return rotary_embedding_reference(query.permute(2, 0, 1, 3), new_key.permute(2, 0, 1, 3),
                                      positions.reshape(-1, 1), inv_freq)


def decode_attention(query, keys, values, position, slopes, scale, new_key=None, new_value=None, rotary=None):
    """One query per row and head at position p of a fixed-size key/value cache of g groups (see
    ``reference.decode_attention_reference`` for the math and shapes: query [b, np, 1, hn], keys and
    values [b, g, T, hn] with g dividing np, head j reading group j // (np / g); given new_key and
    new_value, the step's own [b, g, 1, hn] (of any strides: the value is given the key's), they
    are first written into the cache at p). The query may also be [b, g, np / g, 1, hn]: the grouped
    rows of the QKV projection's output, read where they are. ``rotary`` = (inv_freq [d / 2] fp32,
    positions [b] or [1] integers), with new_key: the query and new_key come before the rotary
    embedding at those positions (``fused_kernels.rotary_embedding``'s math), which is applied here.
    The Triton kernel runs on CUDA for fp16/bf16/fp32 with contiguous caches and reads only
    positions 0 .. p; anything else runs the reference."""
    _check_decode_attention_arguments(query, keys, values, position, new_key, new_value, rotary)
    inv_freq, positions = (rotary[0], rotary[1].reshape(-1)) if rotary is not None else (None, None)
    if (keys.is_contiguous() and values.is_contiguous() and query.stride(-1) == 1 and position.is_cuda
            and (slopes is None or slopes.is_cuda and slopes.is_contiguous())
            and (new_key is None or new_key.stride(-1) == 1)
            and (rotary is None or inv_freq.is_cuda and inv_freq.is_contiguous() and positions.is_cuda)
            and _decode_inputs_fit(query.dtype, query, keys, values, new_key, new_value)
            and _decode_kernels_available()):
        if new_key is None:
            return torch.ops.megatron.decode_attention(query, keys, values, position, slopes, scale)
        if new_value.stride() != new_key.stride():
            # the kernel reads the step's key and value with one set of strides
            new_value = torch.empty_strided(new_key.shape, new_key.stride(), dtype=new_value.dtype,
                                            device=new_value.device).copy_(new_value)
        return torch.ops.megatron.decode_attention_write(query, new_key, new_value, keys, values, position, slopes,
                                                         scale, inv_freq, positions)
    query = query.reshape(_attention_output_shape(query))
    if rotary is not None:
        query, new_key = _rotated_reference(query, new_key, rotary)
    return reference.decode_attention_reference(query, keys, values, position, slopes, scale, new_key, new_value)
