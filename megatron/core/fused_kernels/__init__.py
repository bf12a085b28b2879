"""Fused kernels for the memory-bound steps of a GPT layer, each with a plain-torch reference.

``scale_mask_softmax``, ``layer_norm``, ``rms_norm``, ``bias_gelu``, ``bias_dropout_add`` and
``split_query_key_value`` (``training_ops``; multi-head and grouped-query layouts) run Triton
kernels (forward and backward; the split's forward is views, for grouped queries the query a copy)
on CUDA when their constraints hold, and the references (``*_reference``) otherwise and always on
CPU; ``selection`` states the rules. ``swiglu`` and ``rotary_embedding`` (``elementwise_ops``:
a Llama-style layer's gated activation, and the rotation of its queries and keys in one launch)
follow the same rules. ``linear``, ``layer_norm_linear`` (one row of input, with a
LayerNorm or RMSNorm, a GeLU or SwiGLU activation, or a residual folded in) and
``decode_attention`` (over a key/value cache of g groups) (``decode_ops``) are the forward-only
kernels of a one-token decoding step. ``adamw_step`` is the optimizer's: one pass over a flat fp32 tensor that also writes the weights' bf16 copy.
``fp8_ops`` holds FP8 quantization's two passes (a matrix's absolute maxima; its FP8 copy and FP8
transpose from one read). The
environment variable ``MEGATRON_FUSED_KERNELS=0`` or ``set_fused_kernels_enabled(False)`` forces
the references.
"""
from megatron.core.fused_kernels.decode_ops import decode_attention, layer_norm_linear, linear
from megatron.core.fused_kernels.elementwise_ops import (rotary_embedding, rotary_embedding_reference, swiglu,
                                                        swiglu_reference)
from megatron.core.fused_kernels.selection import (FusedKernelArgumentError, fused_kernels_enabled,
                                                   set_fused_kernels_enabled)
from megatron.core.fused_kernels.training_ops import (adamw_step, bias_dropout_add, bias_gelu, layer_norm,
                                                      rms_norm, scale_mask_softmax, split_query_key_value)
from megatron.core.fused_kernels.reference import (
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

__all__ = [
    "FusedKernelArgumentError",
    "adamw_step",
    "adamw_step_reference",
    "bias_dropout_add",
    "bias_dropout_add_reference",
    "bias_gelu",
    "bias_gelu_reference",
    "causal_mask",
    "decode_attention",
    "decode_attention_reference",
    "fused_kernels_enabled",
    "layer_norm",
    "layer_norm_linear",
    "layer_norm_linear_reference",
    "layer_norm_reference",
    "linear",
    "linear_reference",
    "rms_norm",
    "rms_norm_reference",
    "rotary_embedding",
    "rotary_embedding_reference",
    "scale_mask_softmax",
    "scale_mask_softmax_reference",
    "set_fused_kernels_enabled",
    "split_query_key_value",
    "split_query_key_value_reference",
    "swiglu",
    "swiglu_reference",
]
