"""Triton cross entropy over a vocabulary slice: one read of the logits forward, one read and one write
backward, with no [n, V] temporary.

For a row of logits z over this rank's vocabulary columns [start, start + v):

forward     m_r = max_j z_j,   s_r = sum_j exp(z_j - m_r),   z_t (the target's logit, 0 when the
            target lies outside the slice), by an online max-and-rescale sweep over column blocks;
            the caller combines the slices of the TP ranks into m and s = sum_r s_r exp(m_r - m).
backward    dloss/dz_j = (exp(z_j - m) / s - [j == t]) * g, recomputed from z, m and s.

Arithmetic in fp32 whatever the logits' dtype; the gradient is rounded once to it.
This module imports triton; ``selection.kernel_module`` imports it only when a CUDA tensor needs it.
"""
import torch
import triton
import triton.language as tl

from megatron.core.fused_kernels.launch import cdiv

_FORWARD_BLOCK = 4096
_BACKWARD_BLOCK = 4096
_LOWEST = tl.constexpr(-3.0e38)  # finite, so that exp(m_old - m_new) of an untouched lane is exp(0)


@triton.jit
def _slice_statistics_kernel(logits, target, row_max, row_sum, target_logit, n_cols, vocab_start, stride,
                             BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    lanes = tl.arange(0, BLOCK)
    lane_max = tl.full([BLOCK], _LOWEST, tl.float32)
    lane_sum = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + lanes
        z = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(lane_max, z)
        lane_sum = lane_sum * tl.exp(lane_max - new_max) + tl.exp(z - new_max)
        lane_max = new_max
    m = tl.max(lane_max, axis=0)
    s = tl.sum(lane_sum * tl.exp(lane_max - m), axis=0)
    local = tl.load(target + row).to(tl.int64) - vocab_start
    inside = (local >= 0) & (local < n_cols)
    z_t = tl.load(base + tl.where(inside, local, 0)).to(tl.float32)
    tl.store(row_max + row, m)
    tl.store(row_sum + row, s)
    tl.store(target_logit + row, tl.where(inside, z_t, 0.0))


@triton.jit
def _cross_entropy_backward_kernel(logits, grad_logits, target, row_max, row_sum, grad_loss, n_cols, vocab_start,
                                   stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < n_cols
    z = tl.load(logits + row * stride + cols, mask=in_row, other=0.0).to(tl.float32)
    probability = tl.exp(z - tl.load(row_max + row)) / tl.load(row_sum + row)
    local = tl.load(target + row).to(tl.int64) - vocab_start
    grad = (probability - tl.where(cols == local, 1.0, 0.0)) * tl.load(grad_loss + row)
    tl.store(grad_logits + row * n_cols + cols, grad.to(grad_logits.dtype.element_ty), mask=in_row)


def slice_statistics(logits2d, target, vocab_start):
    """(row max [n], sum of exp(z - row max) [n], target logit or 0 [n]), fp32, of logits2d [n, v]
    (unit stride along v) against targets [n] of the full vocabulary."""
    n_rows, n_cols = logits2d.shape
    row_max, row_sum, target_logit = (torch.empty(n_rows, dtype=torch.float32, device=logits2d.device)
                                      for _ in range(3))
    _slice_statistics_kernel[(n_rows,)](logits2d, target, row_max, row_sum, target_logit, n_cols, vocab_start,
                                        logits2d.stride(0), BLOCK=_FORWARD_BLOCK, num_warps=8)
    return row_max, row_sum, target_logit


def cross_entropy_backward(logits2d, target, row_max, row_sum, grad_loss, vocab_start):
    """grad logits [n, v] (contiguous, logits2d's dtype) given the global row max and sum [n] and the
    loss gradient [n] (fp32)."""
    n_rows, n_cols = logits2d.shape
    grad_logits = torch.empty((n_rows, n_cols), dtype=logits2d.dtype, device=logits2d.device)
    _cross_entropy_backward_kernel[(n_rows, cdiv(n_cols, _BACKWARD_BLOCK))](
        logits2d, grad_logits, target, row_max, row_sum, grad_loss, n_cols, vocab_start, logits2d.stride(0),
        BLOCK=_BACKWARD_BLOCK, num_warps=8)
    return grad_logits
