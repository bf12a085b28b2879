"""The two memory passes of FP8 quantization (tensor_parallel/fp8.py), each one kernel on a GPU.

For a 2-d x [m, n] in fp32, fp16 or bf16:

    ``absolute_maxima(x, tensor, rows, columns)``
        -> (max |x| [] or None, max_j |x_ij| [m, 1] or None, max_i |x_ij| [n] or None), fp32, from
        one read of x (the Triton kernel reduces each tile and merges with atomic maxima).
    ``quantize_pair(x, dtype, row_scale, column_scale, record=None)``
        -> (q [m, n], q_t [n, m]) in the FP8 ``dtype``, both row-major:
           q    = sat(round(x_ij s_i))     s_i = row_scale[i]  ([m, 1], or one scale [])
           q_t  = sat(round(x_ij t_j))^T   t_j = column_scale[j] ([n], or one scale [])
        from one read of x; sat clamps to +-the format's max. ``record`` (a one-element fp32 tensor
        or view) gets max(record, max |x|) in the same pass: delayed scaling's amax.

    ``scales_from_amax(amax, limit, margin)``
        -> (s, 1 / s) for each element of the fp32 ``amax``: s = limit / (amax 2^margin), or 1 where
        amax is 0 or not finite (the scales of fp8.py, with the inverses the GEMMs multiply by), in
        one launch instead of a handful of elementwise ops.

The references do the same in torch ops (CPU, the emulation of the tests, and any input the kernel
does not take); the kernel's float-to-FP8 conversion rounds to nearest even, as torch's cast does.
"""
import torch

from megatron.core.fused_kernels.selection import FusedKernelArgumentError, dtype_violation, fused_or_reference

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check_matrix(op, x):
    if x.dim() != 2:
        raise FusedKernelArgumentError(f"{op}: x must be 2-d [m, n], got shape {tuple(x.shape)}")


def _matrix_violation(x):
    if x.numel() == 0:
        return "x is empty"
    if x.stride(-1) != 1:
        return "x's rows are not contiguous"
    return dtype_violation("x", x)


def _scales_violation(*scales):
    for scale in scales:
        if scale is not None and (scale.dtype != torch.float32 or not scale.is_contiguous()):
            return "a scale (or the record) is not a contiguous fp32 tensor"
    return None


def saturating_cast(x, scale, dtype):
    """sat(round(x s)) in the FP8 ``dtype``, x s in fp32; scale one value or broadcast over x's rows
    or columns."""
    limit = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-limit, limit).to(dtype)


def absolute_maxima_reference(x, tensor=True, rows=False, columns=False):
    magnitude = x.abs().float()
    return (magnitude.amax() if tensor else None, magnitude.amax(dim=1, keepdim=True) if rows else None,
            magnitude.amax(dim=0) if columns else None)


def absolute_maxima(x, tensor=True, rows=False, columns=False):
    """(max |x|, the rows' maxima [m, 1], the columns' maxima [n]), each None when not asked; fp32."""
    _check_matrix("absolute_maxima", x)
    return fused_or_reference("triton_fp8", (x,), lambda: _matrix_violation(x),
                              lambda kernels: kernels.absolute_maxima(x, tensor, rows, columns),
                              lambda: absolute_maxima_reference(x, tensor, rows, columns))


def quantize_pair_reference(x, dtype, row_scale, column_scale, record=None):
    if record is not None:
        record.copy_(torch.maximum(record, x.abs().amax().float()))
    column_scale = column_scale if column_scale.dim() == 0 else column_scale.reshape(1, -1)
    return saturating_cast(x, row_scale, dtype), saturating_cast(x, column_scale, dtype).t().contiguous()


def quantize_pair(x, dtype, row_scale, column_scale, record=None):
    """x quantized with its rows' scales and, transposed, with its columns' scales (module docstring)."""
    _check_matrix("quantize_pair", x)
    if dtype not in FP8_DTYPES:
        raise FusedKernelArgumentError(f"quantize_pair: dtype must be one of {FP8_DTYPES}, got {dtype}")
    m, n = x.shape
    if row_scale.dim() not in (0, 2) or row_scale.dim() == 2 and tuple(row_scale.shape) != (m, 1) \
            or column_scale.dim() not in (0, 1) or column_scale.dim() == 1 and column_scale.shape[0] != n:
        raise FusedKernelArgumentError(f"quantize_pair: row_scale must be [] or [{m}, 1] and column_scale [] or "
                                       f"[{n}], got {tuple(row_scale.shape)} and {tuple(column_scale.shape)}")
    return fused_or_reference("triton_fp8", (x, row_scale, column_scale, record),
                              lambda: _matrix_violation(x) or _scales_violation(row_scale, column_scale, record),
                              lambda kernels: kernels.quantize_pair(x, dtype, row_scale, column_scale, record),
                              lambda: quantize_pair_reference(x, dtype, row_scale, column_scale, record))


def scale_from_amax_reference(amax, limit, margin):
    """s = limit / (amax 2^margin) in fp32, elementwise; 1 where amax is 0 or not finite."""
    amax = amax.float()
    usable = torch.isfinite(amax) & (amax > 0)
    return torch.where(usable, limit / (torch.where(usable, amax, 1.0) * 2.0 ** margin), 1.0)


def scales_from_amax_reference(amax, limit, margin):
    scale = scale_from_amax_reference(amax, limit, margin)
    return scale, scale.reciprocal()


def scales_from_amax(amax, limit, margin):
    """(s, 1 / s) from amaxes (module docstring)."""
    return fused_or_reference("triton_fp8", (amax,),
                              lambda: None if amax.dtype == torch.float32 and amax.is_contiguous()
                              else "amax is not a contiguous fp32 tensor",
                              lambda kernels: kernels.scales_from_amax(amax, limit, margin),
                              lambda: scales_from_amax_reference(amax, limit, margin))
