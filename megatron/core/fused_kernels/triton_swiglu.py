"""Triton SwiGLU: y = a * silu(g) of x = [a | g], one pass forward and one pass backward.

x [m, 2n] holds per row the linear half a = x[:, :n] and the gate g = x[:, n:];
    y  = a * silu(g),                    silu(g) = g * s,  s = sigmoid(g)
    da = dy * silu(g)
    dg = dy * a * silu'(g),              silu'(g) = s * (1 + g * (1 - s))
all in fp32 with one rounding at each store. Forward reads x once and writes y [m, n]; backward
reads x (the only tensor kept) and dy once and writes dx = [da | dg] [m, 2n] once, so the
[m, n] tensors autograd keeps and makes between the chunk, the SiLU and the product never exist.
Programs: one per [BLOCK_M, BLOCK_N] tile of y (rows of the m, columns of the n).

This module imports triton; ``selection.kernel_module`` imports it only when a CUDA tensor needs it.
"""
import torch
import triton
import triton.language as tl

from megatron.core.fused_kernels.launch import cdiv, next_power_of_2

_TILE_ELEMENTS = 4096
_MAX_COLUMNS = 1024
_NUM_WARPS = 4


@triton.jit
def _tile_offsets(n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(x offsets of the tile's a, y offsets, in_bounds) of tile (program_id(0), program_id(1)) of y [m, n]."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_bounds = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    return rows64 * (2 * n_cols) + cols[None, :], rows64 * n_cols + cols[None, :], in_bounds


@triton.jit
def _swiglu_forward_kernel(x_ptr, y_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    x_offsets, y_offsets, in_bounds = _tile_offsets(n_rows, n_cols, BLOCK_M, BLOCK_N)
    a = tl.load(x_ptr + x_offsets, mask=in_bounds, other=0.0).to(tl.float32)
    g = tl.load(x_ptr + x_offsets + n_cols, mask=in_bounds, other=0.0).to(tl.float32)
    y = a * g * tl.sigmoid(g)
    tl.store(y_ptr + y_offsets, y.to(y_ptr.dtype.element_ty), mask=in_bounds)


@triton.jit
def _swiglu_backward_kernel(grad_y_ptr, x_ptr, grad_x_ptr, n_rows, n_cols,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    x_offsets, y_offsets, in_bounds = _tile_offsets(n_rows, n_cols, BLOCK_M, BLOCK_N)
    a = tl.load(x_ptr + x_offsets, mask=in_bounds, other=0.0).to(tl.float32)
    g = tl.load(x_ptr + x_offsets + n_cols, mask=in_bounds, other=0.0).to(tl.float32)
    grad_y = tl.load(grad_y_ptr + y_offsets, mask=in_bounds, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    grad_a = grad_y * g * s
    grad_g = grad_y * a * s * (1.0 + g * (1.0 - s))
    tl.store(grad_x_ptr + x_offsets, grad_a.to(grad_x_ptr.dtype.element_ty), mask=in_bounds)
    tl.store(grad_x_ptr + x_offsets + n_cols, grad_g.to(grad_x_ptr.dtype.element_ty), mask=in_bounds)


def tile_for(n_cols, tile_elements=_TILE_ELEMENTS, max_columns=_MAX_COLUMNS):
    """(BLOCK_M, BLOCK_N): whole rows of y up to ``max_columns`` wide, about ``tile_elements`` per tile."""
    block_n = min(next_power_of_2(n_cols), max_columns)
    return max(1, tile_elements // block_n), block_n


def swiglu_forward(x2d, tile=None, num_warps=_NUM_WARPS):
    """y [m, n] = a * silu(g) of a contiguous x2d [m, 2n], in x2d's dtype."""
    n_rows, n_cols = x2d.shape[0], x2d.shape[1] // 2
    block_m, block_n = tile or tile_for(n_cols)
    y = torch.empty((n_rows, n_cols), dtype=x2d.dtype, device=x2d.device)
    _swiglu_forward_kernel[(cdiv(n_rows, block_m), cdiv(n_cols, block_n))](
        x2d, y, n_rows, n_cols, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return y


def swiglu_backward(grad_y2d, x2d, tile=None, num_warps=_NUM_WARPS):
    """dx [m, 2n] = [dy * silu(g) | dy * a * silu'(g)] of contiguous grad_y2d [m, n] and x2d [m, 2n]."""
    n_rows, n_cols = grad_y2d.shape
    block_m, block_n = tile or tile_for(n_cols)
    grad_x = torch.empty_like(x2d)
    _swiglu_backward_kernel[(cdiv(n_rows, block_m), cdiv(n_cols, block_n))](
        grad_y2d, x2d, grad_x, n_rows, n_cols, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return grad_x


class SwiGLUFunction(torch.autograd.Function):
    """Autograd wrapper over ``swiglu_forward`` / ``swiglu_backward``: x [..., 2n] -> y [..., n].

    A non-contiguous x (or incoming gradient) is copied to a contiguous one first; only x is saved."""

    @staticmethod
    def forward(ctx, x):
        x2d = x.contiguous().view(-1, x.shape[-1])  # [m, 2n]
        ctx.save_for_backward(x2d)
        return swiglu_forward(x2d).view(*x.shape[:-1], x.shape[-1] // 2)

    @staticmethod
    def backward(ctx, grad_y):
        (x2d,) = ctx.saved_tensors
        grad_y2d = grad_y.contiguous().view(x2d.shape[0], x2d.shape[1] // 2)  # [m, n]
        return swiglu_backward(grad_y2d, x2d).view(*grad_y.shape[:-1], x2d.shape[1])
