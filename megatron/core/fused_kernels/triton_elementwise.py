"""Triton bias + GeLU and bias + dropout + add: one pass forward, one pass backward.

Both work on [n, h] views (rows of the hidden size h, the bias broadcast over rows) in tiles of
[BLOCK_M, BLOCK_N], arithmetic in fp32 and one rounding at the store.

bias_gelu:   out = gelu_tanh(t), t = y + bias, with gelu_tanh(t) = t * sigmoid(2u),
             u = sqrt(2/pi) (t + 0.044715 t^3)  (the same as 0.5 t (1 + tanh u)).
             d out / d t = s + 2 t s (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 t^2), s = sigmoid(2u).
             Backward recomputes t from y and bias (nothing but y is kept).

bias_dropout_add: out = residual + keep * (x + bias) / (1 - p). keep = (r >> 8) >= p * 2^24 for a
             32-bit Philox output r: element (row, col) takes output col % 4 of the Philox4x32-10
             counter row * ceil(h / 4) + col // 4 (one counter feeds four elements: the generator
             is the costly part of the kernel). The seed is a one-element int64 tensor drawn from
             torch's default generator of the device, so replaying the generator state
             (activation checkpointing) replays the mask; backward regenerates the mask from the
             seed instead of storing it.

Backward kernels also reduce grad over rows into the bias gradient: a fixed number of programs per
column block, each striding over rows with fp32 partial sums, added by torch afterwards (without
dropout the bias_dropout_add backward is this column sum alone: torch's sum over dim 0 of a
[n, h] tensor reaches about half the bandwidth).

This module imports triton; ``selection.kernel_module`` imports it only when a CUDA tensor needs it.
"""
import torch
import triton
import triton.language as tl

from megatron.core.fused_kernels.launch import ELEMENTWISE_PROGRAMS_PER_SM, cdiv, next_power_of_2, reduction_programs

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_CUBIC = tl.constexpr(0.044715)
_KEEP_BITS = tl.constexpr(24)
_FORWARD_TILE_ELEMENTS = 2048
_FORWARD_MAX_COLUMNS = 1024
_BACKWARD_TILE_ELEMENTS = 8192  # 8 x 1024: bias_gelu backward 12 % faster than 4 x 1024 on an H200, dropout unchanged
_BACKWARD_MAX_COLUMNS = 1024
_MIN_COLUMNS = 16  # tiles start at multiples of 4 columns, as the dropout noise needs
_NUM_WARPS = 4


@triton.jit
def gelu_tanh(t):
    return t * tl.sigmoid(2.0 * _SQRT_2_OVER_PI * (t + _GELU_CUBIC * t * t * t))


@triton.jit
def _gelu_tanh_grad(t):
    s = tl.sigmoid(2.0 * _SQRT_2_OVER_PI * (t + _GELU_CUBIC * t * t * t))
    return s + 2.0 * t * s * (1.0 - s) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * t * t)


@triton.jit
def _keep_mask(seed, rows, n_cols, drop_threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] keep mask of the tile at ``rows`` and column block program_id(1)."""
    quads = tl.program_id(1) * (BLOCK_N // 4) + tl.arange(0, BLOCK_N // 4)
    counters = rows[:, None] * tl.cdiv(n_cols, 4) + quads[None, :]  # [BLOCK_M, BLOCK_N / 4]
    r0, r1, r2, r3 = tl.randint4x(seed, counters)
    # join twice: [BLOCK_M, BLOCK_N / 4, 2, 2], row-major, so column 4q + j holds r_j[q]
    noise = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [BLOCK_M, BLOCK_N])
    return (noise >> (32 - _KEEP_BITS)).to(tl.int32) >= drop_threshold


@triton.jit
def _tile(n_rows, n_cols, row_start, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(cols, flat offsets, in_bounds) of the tile at ``row_start`` and column block program_id(1)."""
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_bounds = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offsets = rows[:, None] * n_cols + cols[None, :]
    return cols, offsets, in_bounds


@triton.jit
def _bias_gelu_forward_kernel(y_ptr, bias_ptr, out_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    cols, offsets, in_bounds = _tile(n_rows, n_cols, tl.program_id(0) * BLOCK_M, BLOCK_M, BLOCK_N)
    bias = tl.load(bias_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    t = tl.load(y_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32) + bias[None, :]
    tl.store(out_ptr + offsets, gelu_tanh(t).to(out_ptr.dtype.element_ty), mask=in_bounds)


@triton.jit
def _bias_gelu_backward_kernel(
    grad_out_ptr, y_ptr, bias_ptr, grad_y_ptr, partial_grad_bias_ptr, n_rows, n_cols,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    program = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    bias = tl.load(bias_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    grad_bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    for row_start in range(program * BLOCK_M, n_rows, n_programs * BLOCK_M):
        _, offsets, in_bounds = _tile(n_rows, n_cols, row_start, BLOCK_M, BLOCK_N)
        t = tl.load(y_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32) + bias[None, :]
        grad_out = tl.load(grad_out_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
        grad_t = tl.where(in_bounds, grad_out * _gelu_tanh_grad(t), 0.0)
        tl.store(grad_y_ptr + offsets, grad_t.to(grad_y_ptr.dtype.element_ty), mask=in_bounds)
        grad_bias += tl.sum(grad_t, axis=0)
    tl.store(partial_grad_bias_ptr + program * n_cols + cols, grad_bias, mask=cols < n_cols)


@triton.jit
def _bias_dropout_add_forward_kernel(
    x_ptr, bias_ptr, residual_ptr, out_ptr, seed_ptr, n_rows, n_cols, drop_threshold, keep_scale,
    HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row_start = tl.program_id(0) * BLOCK_M
    cols, offsets, in_bounds = _tile(n_rows, n_cols, row_start, BLOCK_M, BLOCK_N)
    t = tl.load(x_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
    if HAS_BIAS:
        t += tl.load(bias_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
    if DROPOUT:
        keep = _keep_mask(tl.load(seed_ptr), row_start + tl.arange(0, BLOCK_M), n_cols, drop_threshold, BLOCK_M, BLOCK_N)
        t = tl.where(keep, t * keep_scale, 0.0)
    out = tl.load(residual_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32) + t
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=in_bounds)


@triton.jit
def _dropout_backward_kernel(
    grad_out_ptr, grad_x_ptr, partial_grad_bias_ptr, seed_ptr, n_rows, n_cols, drop_threshold, keep_scale,
    DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    program = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    grad_bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    for row_start in range(program * BLOCK_M, n_rows, n_programs * BLOCK_M):
        _, offsets, in_bounds = _tile(n_rows, n_cols, row_start, BLOCK_M, BLOCK_N)
        grad_x = tl.load(grad_out_ptr + offsets, mask=in_bounds, other=0.0).to(tl.float32)
        if DROPOUT:
            keep = _keep_mask(tl.load(seed_ptr), row_start + tl.arange(0, BLOCK_M), n_cols, drop_threshold,
                              BLOCK_M, BLOCK_N)
            grad_x = tl.where(keep & in_bounds, grad_x * keep_scale, 0.0)
            tl.store(grad_x_ptr + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=in_bounds)
        grad_bias += tl.sum(grad_x, axis=0)
    tl.store(partial_grad_bias_ptr + program * n_cols + cols, grad_bias, mask=cols < n_cols)


def forward_tile(n_cols):
    """(BLOCK_M, BLOCK_N) of the forward kernels: whole rows up to _FORWARD_MAX_COLUMNS wide."""
    block_n = min(max(next_power_of_2(n_cols), _MIN_COLUMNS), _FORWARD_MAX_COLUMNS)
    return max(1, _FORWARD_TILE_ELEMENTS // block_n), block_n


def backward_tile(n_cols):
    """(BLOCK_M, BLOCK_N) of the backward kernels, which loop over rows."""
    block_n = min(max(next_power_of_2(n_cols), _MIN_COLUMNS), _BACKWARD_MAX_COLUMNS)
    return max(1, _BACKWARD_TILE_ELEMENTS // block_n), block_n


def _forward_grid(n_rows, n_cols, tile):
    return (cdiv(n_rows, tile[0]), cdiv(n_cols, tile[1]))


def _backward_grid(device, n_rows, n_cols, tile, programs_per_sm):
    """(row programs, column blocks): about reduction_programs(device) programs in all."""
    column_blocks = cdiv(n_cols, tile[1])
    n_tiles = column_blocks * cdiv(n_rows, tile[0])
    programs = reduction_programs(device, n_tiles, programs_per_sm or ELEMENTWISE_PROGRAMS_PER_SM)
    row_programs = max(1, programs // column_blocks)
    return (row_programs, column_blocks)


def _drop_threshold(prob):
    """Integer threshold of the dropout noise: (r >> 8) < threshold drops, with chance ~prob."""
    return round(prob * 2**_KEEP_BITS.value)


def bias_gelu_forward(y2d, bias, tile=None, num_warps=_NUM_WARPS):
    """gelu_tanh(y2d + bias) of a contiguous y2d [n, h], in y2d's dtype."""
    n_rows, n_cols = y2d.shape
    tile = tile or forward_tile(n_cols)
    out = torch.empty_like(y2d)
    _bias_gelu_forward_kernel[_forward_grid(n_rows, n_cols, tile)](
        y2d, bias, out, n_rows, n_cols, BLOCK_M=tile[0], BLOCK_N=tile[1], num_warps=num_warps
    )
    return out


def bias_gelu_backward(grad_out2d, y2d, bias, tile=None, num_warps=_NUM_WARPS, programs_per_sm=None):
    """(grad_y [n, h], grad_bias [h] fp32) from a contiguous grad_out2d [n, h]."""
    n_rows, n_cols = y2d.shape
    tile = tile or backward_tile(n_cols)
    grid = _backward_grid(y2d.device, n_rows, n_cols, tile, programs_per_sm)
    grad_y = torch.empty_like(y2d)
    partial_grad_bias = torch.empty((grid[0], n_cols), dtype=torch.float32, device=y2d.device)
    _bias_gelu_backward_kernel[grid](
        grad_out2d, y2d, bias, grad_y, partial_grad_bias, n_rows, n_cols,
        BLOCK_M=tile[0], BLOCK_N=tile[1], num_warps=num_warps,
    )
    return grad_y, partial_grad_bias.sum(0)


def bias_dropout_add_forward(x2d, bias, residual2d, prob, seed, tile=None, num_warps=_NUM_WARPS):
    """residual + dropout(x + bias) of contiguous [n, h] tensors; ``seed`` None means no dropout."""
    n_rows, n_cols = x2d.shape
    tile = tile or forward_tile(n_cols)
    out = torch.empty_like(x2d)
    _bias_dropout_add_forward_kernel[_forward_grid(n_rows, n_cols, tile)](
        x2d, x2d if bias is None else bias, residual2d, out, x2d if seed is None else seed,
        n_rows, n_cols, _drop_threshold(prob), 1.0 / (1.0 - prob),
        HAS_BIAS=bias is not None, DROPOUT=seed is not None, BLOCK_M=tile[0], BLOCK_N=tile[1], num_warps=num_warps,
    )
    return out


def dropout_backward(grad_out2d, prob, seed, tile=None, num_warps=_NUM_WARPS, programs_per_sm=None):
    """(grad_x [n, h], grad_bias [h] fp32) of the dropout drawn with ``seed``; with ``seed`` None (no
    dropout) grad_x is grad_out2d itself and the kernel only sums its columns."""
    n_rows, n_cols = grad_out2d.shape
    tile = tile or backward_tile(n_cols)
    grid = _backward_grid(grad_out2d.device, n_rows, n_cols, tile, programs_per_sm)
    grad_x = grad_out2d if seed is None else torch.empty_like(grad_out2d)
    partial_grad_bias = torch.empty((grid[0], n_cols), dtype=torch.float32, device=grad_out2d.device)
    _dropout_backward_kernel[grid](
        grad_out2d, grad_x, partial_grad_bias, grad_out2d if seed is None else seed, n_rows, n_cols,
        _drop_threshold(prob), 1.0 / (1.0 - prob),
        DROPOUT=seed is not None, BLOCK_M=tile[0], BLOCK_N=tile[1], num_warps=num_warps,
    )
    return grad_x, partial_grad_bias.sum(0)


def draw_dropout_seed(device):
    """A one-element int64 tensor on ``device`` drawn from torch's default generator (no host sync)."""
    return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device)


class BiasGeluFunction(torch.autograd.Function):
    """Autograd wrapper over ``bias_gelu_forward`` / ``bias_gelu_backward``; y may be [..., h]."""

    @staticmethod
    def forward(ctx, bias, y):
        y2d = y.contiguous().view(-1, y.shape[-1])  # [n, h]
        ctx.save_for_backward(bias, y2d)
        return bias_gelu_forward(y2d, bias.contiguous()).view(y.shape)

    @staticmethod
    def backward(ctx, grad_out):
        bias, y2d = ctx.saved_tensors
        grad_y, grad_bias = bias_gelu_backward(grad_out.contiguous().view(y2d.shape), y2d, bias.contiguous())
        return grad_bias.to(bias.dtype), grad_y.view(grad_out.shape)


class BiasDropoutAddFunction(torch.autograd.Function):
    """Autograd wrapper over ``bias_dropout_add_forward``; dropout is active when ``dropout`` is true."""

    @staticmethod
    def forward(ctx, x, bias, residual, prob, dropout):
        hidden = x.shape[-1]
        x2d = x.contiguous().view(-1, hidden)  # [n, h]
        seed = draw_dropout_seed(x.device) if dropout else None
        bias_arg = None if bias is None else bias.contiguous()
        out = bias_dropout_add_forward(x2d, bias_arg, residual.contiguous().view(-1, hidden), prob, seed)
        ctx.save_for_backward(seed)
        ctx.prob = prob
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        (seed,) = ctx.saved_tensors
        hidden = grad_out.shape[-1]
        grad_out2d = grad_out.contiguous().view(-1, hidden)  # [n, h]
        if ctx.bias_dtype is None and seed is None:
            return grad_out, None, grad_out, None, None
        grad_x2d, grad_bias = dropout_backward(grad_out2d, ctx.prob, seed)
        grad_bias = None if ctx.bias_dtype is None else grad_bias.to(ctx.bias_dtype)
        return grad_x2d.view(grad_out.shape), grad_bias, grad_out, None, None
