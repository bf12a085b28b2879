"""Triton scale-mask-softmax: one pass over the scores forward, one over (probs, grad) backward.

Forward, per row of scores [b, np, sq, sk] viewed as [b*np*sq, sk]::

    x_k = scale * scores_k           if key k is visible
        = finfo(float32).min         if k is masked (causal or by the mask)
    probs_k = exp(x_k - max x) / sum_j exp(x_j - max x)

computed in fp32 whatever the input dtype, so masked keys get probability exactly 0 and a fully
masked row is uniform, as in ``reference.scale_mask_softmax_reference``. Causal masking is computed
from the indices: the masked upper triangle is never read, only written (zeros).

Backward: grad_scores_k = scale * p_k * (g_k - sum_j p_j g_j) on visible keys, 0 on masked ones
(masked_fill passes no gradient).

This module imports triton; ``selection.kernel_module`` imports it only when a CUDA tensor needs it.
"""
import torch
import triton
import triton.language as tl

from megatron.core.fused_kernels.launch import cdiv, next_power_of_2

_MASKED_SCORE = tl.constexpr(-3.4028234663852886e38)  # torch.finfo(torch.float32).min
_TILE_ELEMENTS = 2048  # scores per program: several short rows, or one long row
_MAX_ROWS_PER_TILE = 64


@triton.jit
def _program_tile(
    n_rows, n_cols, sq, n_heads, causal_offset,
    mask_ptr, mask_stride_b, mask_stride_h, mask_stride_q, mask_stride_k,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """(offsets, cols, in_bounds, visible) of this program's [BLOCK_M, BLOCK_N] tile of rows
    r = (b * np + h) * sq + q: element offsets into the [n_rows, n_cols] scores, the key index of each
    column, which elements exist, and which of those a query may attend to."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    in_bounds = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    visible = in_bounds
    query = rows % sq
    if CAUSAL:
        visible = visible & (cols[None, :] <= (query + causal_offset)[:, None])
    if HAS_MASK:
        batch_head = rows // sq
        row_offsets = (
            (batch_head // n_heads).to(tl.int64) * mask_stride_b
            + (batch_head % n_heads).to(tl.int64) * mask_stride_h
            + query.to(tl.int64) * mask_stride_q
        )
        mask_offsets = row_offsets[:, None] + cols[None, :].to(tl.int64) * mask_stride_k
        masked = tl.load(mask_ptr + mask_offsets, mask=visible, other=1)
        visible = visible & (masked == 0)
    offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    return offsets, cols, in_bounds, visible


@triton.jit
def _softmax_forward_kernel(
    scores_ptr, probs_ptr, mask_ptr,
    n_rows, n_cols, sq, n_heads, causal_offset, scale,
    mask_stride_b, mask_stride_h, mask_stride_q, mask_stride_k,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    offsets, cols, in_bounds, visible = _program_tile(
        n_rows, n_cols, sq, n_heads, causal_offset,
        mask_ptr, mask_stride_b, mask_stride_h, mask_stride_q, mask_stride_k, HAS_MASK, CAUSAL, BLOCK_M, BLOCK_N,
    )
    x = tl.load(scores_ptr + offsets, mask=visible, other=0.0).to(tl.float32) * scale
    x = tl.where(visible, x, _MASKED_SCORE)
    # Padding columns must weigh nothing even in a fully masked row, hence -inf, not the finite min.
    x = tl.where((cols < n_cols)[None, :], x, float("-inf"))
    row_max = tl.max(x, axis=1)
    numerators = tl.exp(x - row_max[:, None])
    probs = numerators * (1.0 / tl.sum(numerators, axis=1))[:, None]
    tl.store(probs_ptr + offsets, probs.to(probs_ptr.dtype.element_ty), mask=in_bounds)


@triton.jit
def _softmax_backward_kernel(
    grad_probs_ptr, probs_ptr, grad_scores_ptr, mask_ptr,
    n_rows, n_cols, sq, n_heads, causal_offset, scale,
    mask_stride_b, mask_stride_h, mask_stride_q, mask_stride_k,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    offsets, _, in_bounds, visible = _program_tile(
        n_rows, n_cols, sq, n_heads, causal_offset,
        mask_ptr, mask_stride_b, mask_stride_h, mask_stride_q, mask_stride_k, HAS_MASK, CAUSAL, BLOCK_M, BLOCK_N,
    )
    # Masked keys of a row with any visible key have p == 0 exactly, so skipping them leaves the
    # dot product unchanged; a fully masked row gets no gradient at all.
    probs = tl.load(probs_ptr + offsets, mask=visible, other=0.0).to(tl.float32)
    grad_probs = tl.load(grad_probs_ptr + offsets, mask=visible, other=0.0).to(tl.float32)
    dot = tl.sum(probs * grad_probs, axis=1)
    grad_scores = scale * probs * (grad_probs - dot[:, None])
    grad_scores = tl.where(visible, grad_scores, 0.0)
    tl.store(grad_scores_ptr + offsets, grad_scores.to(grad_scores_ptr.dtype.element_ty), mask=in_bounds)


def default_launch_config(n_cols):
    """(rows per program, warps) for rows of ``n_cols`` keys: ~_TILE_ELEMENTS scores per program."""
    block_n = next_power_of_2(n_cols)
    block_m = max(1, min(_TILE_ELEMENTS // block_n, _MAX_ROWS_PER_TILE))
    num_warps = min(16, max(4, block_m * block_n // 512))
    return block_m, num_warps


def _launch(kernel, tensors, mask, scale, causal, shape, block_m, num_warps):
    """Shared launch of the forward/backward kernels over rows of a [b, np, sq, sk] tensor."""
    batch, n_heads, sq, sk = shape
    n_rows = batch * n_heads * sq
    default_block_m, default_warps = default_launch_config(sk)
    block_m = block_m or default_block_m
    num_warps = num_warps or default_warps
    if mask is None:
        mask_arg, mask_strides = tensors[0], (0, 0, 0, 0)
    else:
        mask_arg = torch.broadcast_to(mask, shape).view(torch.uint8)  # strides 0 on broadcast dims
        mask_strides = mask_arg.stride()
    grid = (cdiv(n_rows, block_m),)
    kernel[grid](
        *tensors, mask_arg, n_rows, sk, sq, n_heads, sk - sq, float(scale), *mask_strides,
        HAS_MASK=mask is not None, CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=next_power_of_2(sk),
        num_warps=num_warps,
    )


def softmax_forward(scores, mask, scale, causal, block_m=None, num_warps=None):
    """probs [b, np, sq, sk] (scores' dtype) of contiguous ``scores``; see the module docstring."""
    probs = torch.empty_like(scores)
    _launch(_softmax_forward_kernel, (scores, probs), mask, scale, causal, scores.shape, block_m, num_warps)
    return probs


def softmax_backward(grad_probs, probs, mask, scale, causal, block_m=None, num_warps=None):
    """grad_scores [b, np, sq, sk] from contiguous ``grad_probs`` and the forward's ``probs``."""
    grad_scores = torch.empty_like(probs)
    tensors = (grad_probs, probs, grad_scores)
    _launch(_softmax_backward_kernel, tensors, mask, scale, causal, probs.shape, block_m, num_warps)
    return grad_scores


class ScaleMaskSoftmaxFunction(torch.autograd.Function):
    """Autograd wrapper: forward ``softmax_forward``, backward ``softmax_backward`` from the saved probs."""

    @staticmethod
    def forward(ctx, scores, mask, scale, causal):
        probs = softmax_forward(scores.contiguous(), mask, scale, causal)
        ctx.save_for_backward(probs, mask)
        ctx.scale = scale
        ctx.causal = causal
        return probs

    @staticmethod
    def backward(ctx, grad_probs):
        probs, mask = ctx.saved_tensors
        grad_scores = softmax_backward(grad_probs.contiguous(), probs, mask, ctx.scale, ctx.causal)
        return grad_scores, None, None, None
