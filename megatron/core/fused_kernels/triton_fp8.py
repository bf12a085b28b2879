"""Triton kernels of FP8 quantization (fp8_ops has the contracts): the absolute maxima of a matrix,
its FP8 copy with its FP8 transpose from one read, and the scales (with their inverses) of amaxes.

Both walk x [m, n] in BLOCK_M x BLOCK_N tiles, one program per tile. The maxima reduce each tile
along its rows, its columns or whole, and merge into the fp32 outputs (zeroed first) with atomic
maxima, which are exact for the non-negative values here. The quantization scales the tile by the
row scales (or one scale), converts to FP8 and stores it at its place in q, then scales the same
registers by the column scales and stores the transposed tile in q_t; with ``record`` it also
merges the tile's maximum into that one element.

This module imports triton; ``selection.kernel_module`` imports it only when a CUDA tensor needs it.
"""
import torch
import triton
import triton.language as tl

from megatron.core.fused_kernels.launch import cdiv

_BLOCK = 64
_WARPS = 4
_TRITON_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


@triton.jit
def _tile(x_ptr, m, n, stride_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(tile of x in fp32, its rows [BLOCK_M], its columns [BLOCK_N], the in-bounds mask)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows < m)[:, None] & (columns < n)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_m + columns[None, :], mask=inside, other=0.0)
    return x.to(tl.float32), rows, columns, inside


@triton.jit
def _absolute_maxima_kernel(x_ptr, tensor_ptr, rows_ptr, columns_ptr, m, n, stride_m, TENSOR: tl.constexpr,
                            ROWS: tl.constexpr, COLUMNS: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    x, rows, columns, _ = _tile(x_ptr, m, n, stride_m, BLOCK_M, BLOCK_N)
    magnitude = tl.abs(x)
    if TENSOR:
        tl.atomic_max(tensor_ptr, tl.max(tl.max(magnitude, axis=1), axis=0))
    if ROWS:
        tl.atomic_max(rows_ptr + rows, tl.max(magnitude, axis=1), mask=rows < m)
    if COLUMNS:
        tl.atomic_max(columns_ptr + columns, tl.max(magnitude, axis=0), mask=columns < n)


@triton.jit
def _quantize_pair_kernel(x_ptr, q_ptr, q_t_ptr, row_scale_ptr, column_scale_ptr, record_ptr, m, n, stride_m, limit,
                          ROW_SCALES: tl.constexpr, COLUMN_SCALES: tl.constexpr, RECORD: tl.constexpr,
                          FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    x, rows, columns, inside = _tile(x_ptr, m, n, stride_m, BLOCK_M, BLOCK_N)
    if RECORD:
        tl.atomic_max(record_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    if ROW_SCALES:
        row_scale = tl.load(row_scale_ptr + rows, mask=rows < m, other=1.0)[:, None]
    else:
        row_scale = tl.load(row_scale_ptr)
    if COLUMN_SCALES:
        column_scale = tl.load(column_scale_ptr + columns, mask=columns < n, other=1.0)[None, :]
    else:
        column_scale = tl.load(column_scale_ptr)
    q = tl.clamp(x * row_scale, -limit, limit).to(FP8)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * n + columns[None, :], q, mask=inside)
    q_t = tl.trans(tl.clamp(x * column_scale, -limit, limit).to(FP8))  # [BLOCK_N, BLOCK_M]
    tl.store(q_t_ptr + columns.to(tl.int64)[:, None] * m + rows[None, :], q_t, mask=tl.trans(inside))


@triton.jit
def _scales_kernel(amax_ptr, scale_ptr, inverse_ptr, count, limit, multiplier, BLOCK: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    amax = tl.load(amax_ptr + index, mask=index < count, other=0.0)
    usable = (amax > 0) & (amax < float("inf"))  # false for nan too
    # limit * (1 / x), as torch computes limit / x for a Python number limit (the reference's rounding)
    scale = tl.where(usable, tl.math.div_rn(1.0, tl.where(usable, amax, 1.0) * multiplier) * limit, 1.0)
    tl.store(scale_ptr + index, scale, mask=index < count)
    tl.store(inverse_ptr + index, tl.math.div_rn(1.0, scale), mask=index < count)


def absolute_maxima(x, tensor, rows, columns):
    m, n = x.shape
    zeros = dict(dtype=torch.float32, device=x.device)
    tensor_max = torch.zeros((), **zeros) if tensor else None
    row_max = torch.zeros(m, 1, **zeros) if rows else None
    column_max = torch.zeros(n, **zeros) if columns else None
    placeholder = next(t for t in (tensor_max, row_max, column_max, x) if t is not None)
    _absolute_maxima_kernel[(cdiv(m, _BLOCK), cdiv(n, _BLOCK))](
        x, tensor_max if tensor else placeholder, row_max if rows else placeholder,
        column_max if columns else placeholder, m, n, x.stride(0), TENSOR=tensor, ROWS=rows, COLUMNS=columns,
        BLOCK_M=_BLOCK, BLOCK_N=_BLOCK, num_warps=_WARPS)
    return tensor_max, row_max, column_max


def quantize_pair(x, dtype, row_scale, column_scale, record):
    m, n = x.shape
    q = torch.empty(m, n, dtype=dtype, device=x.device)
    q_t = torch.empty(n, m, dtype=dtype, device=x.device)
    _quantize_pair_kernel[(cdiv(m, _BLOCK), cdiv(n, _BLOCK))](
        x, q, q_t, row_scale, column_scale, row_scale if record is None else record, m, n, x.stride(0),
        torch.finfo(dtype).max, ROW_SCALES=row_scale.dim() > 0, COLUMN_SCALES=column_scale.dim() > 0,
        RECORD=record is not None, FP8=_TRITON_FP8[dtype], BLOCK_M=_BLOCK, BLOCK_N=_BLOCK, num_warps=_WARPS)
    return q, q_t


def scales_from_amax(amax, limit, margin):
    scale, inverse = torch.empty_like(amax), torch.empty_like(amax)
    count = amax.numel()
    _scales_kernel[(cdiv(count, 1024),)](amax, scale, inverse, count, limit, 2.0 ** margin, BLOCK=1024,
                                          num_warps=_WARPS)
    return scale, inverse
