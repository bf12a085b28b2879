"""Triton RMSNorm, forward and backward, with fp32 statistics.

Forward, per row x of [n, h]: rstd = 1/sqrt(sum(x^2)/h + eps), xhat = x * rstd, y = xhat * w.
rstd ([n], fp32) is kept for backward.

Backward, with g = dy * w per row::

    dx = rstd * (g - xhat * mean(g * xhat))  [+ dr]
    dw = sum_rows dy * xhat

The optional dr is the gradient of a second use of x (a pre-norm block's residual), added here as
the layer norm's backward does (triton_layer_norm). dx is written row by row; dw is accumulated in
fp32 registers by a fixed number of programs striding over rows, their partial sums [programs, h]
added by torch afterwards. The launch shapes are the layer norm's.

This module imports triton; ``selection.kernel_module`` imports it only when a CUDA tensor needs it.
"""
import torch
import triton
import triton.language as tl

from megatron.core.fused_kernels.launch import LAYER_NORM_PROGRAMS_PER_SM, cdiv, next_power_of_2, reduction_programs
from megatron.core.fused_kernels.triton_layer_norm import default_launch_config


@triton.jit
def _rms_norm_forward_kernel(x_ptr, weight_ptr, y_ptr, rstd_ptr, n_rows, n_cols, eps, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    in_bounds = row_ok[:, None] & col_ok[None, :]
    offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * weight[None, :]
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=in_bounds)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_backward_kernel(x_ptr, weight_ptr, rstd_ptr, grad_y_ptr, grad_residual_ptr, grad_x_ptr, partial_sums_ptr,
                              n_rows, n_cols, HAS_GRAD_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr):
    program = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    grad_weight = tl.zeros([BLOCK_N], dtype=tl.float32)
    for first_row in range(program * BLOCK_M, n_rows, n_programs * BLOCK_M):
        rows = first_row + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        in_bounds = row_ok[:, None] & col_ok[None, :]
        offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
        grad_y = tl.load(grad_y_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        x_hat = x * rstd[:, None]
        weighted_grad = grad_y * weight[None, :]
        mean_grad_x_hat = tl.sum(weighted_grad * x_hat, axis=1) / n_cols
        grad_x = (weighted_grad - x_hat * mean_grad_x_hat[:, None]) * rstd[:, None]
        if HAS_GRAD_RESIDUAL:
            grad_x += tl.load(grad_residual_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
        tl.store(grad_x_ptr + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=in_bounds)
        grad_weight += tl.sum(grad_y * x_hat, axis=0)
    tl.store(partial_sums_ptr + program * n_cols + cols, grad_weight, mask=col_ok)


def rms_norm_forward(x2d, weight, eps, block_m=None, num_warps=None):
    """(y [n, h] in x's dtype, rstd [n] fp32) of a contiguous x2d [n, h]."""
    n_rows, n_cols = x2d.shape
    default_block_m, default_warps = default_launch_config(n_cols)
    block_m = block_m or default_block_m
    y = torch.empty_like(x2d)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2d.device)
    _rms_norm_forward_kernel[(cdiv(n_rows, block_m),)](
        x2d, weight, y, rstd, n_rows, n_cols, float(eps), BLOCK_M=block_m, BLOCK_N=next_power_of_2(n_cols),
        num_warps=num_warps or default_warps)
    return y, rstd


def rms_norm_backward(grad_y2d, x2d, weight, rstd, grad_residual2d=None, block_m=None, num_warps=None,
                      programs_per_sm=None):
    """(grad_x [n, h], grad_weight [h] fp32) from contiguous grad_y2d [n, h]; a contiguous
    ``grad_residual2d`` [n, h] is added to grad_x."""
    n_rows, n_cols = x2d.shape
    default_block_m, default_warps = default_launch_config(n_cols)
    block_m = block_m or default_block_m
    n_programs = reduction_programs(x2d.device, cdiv(n_rows, block_m), programs_per_sm or LAYER_NORM_PROGRAMS_PER_SM)
    grad_x = torch.empty_like(x2d)
    partial_sums = torch.empty((n_programs, n_cols), dtype=torch.float32, device=x2d.device)
    _rms_norm_backward_kernel[(n_programs,)](
        x2d, weight, rstd, grad_y2d, grad_y2d if grad_residual2d is None else grad_residual2d, grad_x, partial_sums,
        n_rows, n_cols, HAS_GRAD_RESIDUAL=grad_residual2d is not None, BLOCK_M=block_m,
        BLOCK_N=next_power_of_2(n_cols), num_warps=num_warps or default_warps)
    return grad_x, partial_sums.sum(0)


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper over ``rms_norm_forward`` / ``rms_norm_backward``; x may be [..., h].

    With ``return_input`` it returns (y, x) instead of y: x's second use (a residual branch) then
    sends its gradient here, where the backward kernel adds it to the norm's input gradient.
    """

    @staticmethod
    def forward(ctx, x, weight, eps, return_input):
        hidden = x.shape[-1]
        x2d = x.contiguous().view(-1, hidden)  # [n, h], n = product of the leading dims
        y, rstd = rms_norm_forward(x2d, weight.contiguous(), eps)
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.set_materialize_grads(False)
        y = y.view(x.shape)
        return (y, x) if return_input else y

    @staticmethod
    def backward(ctx, grad_y, grad_input=None):
        x2d, weight, rstd = ctx.saved_tensors
        if grad_y is None:
            return grad_input, None, None, None
        grad_y2d = grad_y.contiguous().view(x2d.shape)  # [n, h]
        grad_residual2d = None if grad_input is None else grad_input.contiguous().view(x2d.shape)
        grad_x, grad_weight = rms_norm_backward(grad_y2d, x2d, weight.contiguous(), rstd,
                                                grad_residual2d=grad_residual2d)
        return grad_x.view(grad_y.shape), grad_weight.to(weight.dtype), None, None
