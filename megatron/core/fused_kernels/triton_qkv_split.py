"""Triton backward of the attention's query/key/value split: one pass packs the three gradients and
sums the bias gradient.

The query_key_value projection's output y [s, b, np * 3 * hn] holds, per head j, its query, key and
value rows side by side ([np, 3, hn]); attention reads q, k, v as views of it. Backward gets dq, dk,
dv [s, b, np, hn] in whatever layout attention's backward left them and must hand back

    dy[t, j, i, :] = (dq, dk, dv)[i][t, j, :]   (t a token of the s * b, i in q, k, v)
    db = sum over t of dy[t]                    (the projection's bias gradient, [np * 3 * hn])

autograd's split backward concatenates (a read and a write of dy's size) and the projection's
backward then reads dy again to sum its rows; here the sum is taken from registers during the copy.
Programs: per q, k, v one launch over the heads' hn-column slices, a fixed number of programs per
slice striding over the tokens with fp32 partial sums, added by torch afterwards.

This module imports triton; ``dispatch`` imports it only when a CUDA tensor needs it.
"""
import torch
import triton
import triton.language as tl

from megatron.core.fused_kernels.launch import ELEMENTWISE_PROGRAMS_PER_SM, cdiv, next_power_of_2, reduction_programs

_TILE_ELEMENTS = 8192
_NUM_WARPS = 4


@triton.jit
def _pack_qkv_grad_kernel(
    grad_ptr, out_ptr, partial_sums_ptr, n_tokens, batch, head_dim, n_cols, part, stride_s, stride_b, stride_h,
    SUM_COLUMNS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Copies one of dq, dk, dv (``part`` 0, 1, 2) into its columns of dy; head program_id(1)."""
    program = tl.program_id(0)
    n_programs = tl.num_programs(0)
    head = tl.program_id(1)
    first_column = (head * 3 + part) * head_dim
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    column_sums = tl.zeros([BLOCK_D], dtype=tl.float32)
    for first_token in range(program * BLOCK_M, n_tokens, n_programs * BLOCK_M):
        tokens = first_token + tl.arange(0, BLOCK_M)  # t = position * b + sequence
        in_bounds = (tokens < n_tokens)[:, None] & dim_ok[None, :]
        offsets = (tokens // batch).to(tl.int64) * stride_s + (tokens % batch).to(tl.int64) * stride_b + head * stride_h
        grad = tl.load(grad_ptr + offsets[:, None] + dims[None, :], mask=in_bounds, other=0.0)
        out_offsets = tokens.to(tl.int64)[:, None] * n_cols + (first_column + dims)[None, :]
        tl.store(out_ptr + out_offsets, grad.to(out_ptr.dtype.element_ty), mask=in_bounds)
        if SUM_COLUMNS:
            column_sums += tl.sum(grad.to(tl.float32), axis=0)
    if SUM_COLUMNS:
        tl.store(partial_sums_ptr + program * n_cols + first_column + dims, column_sums, mask=dim_ok)


def pack_qkv_grads(dq, dk, dv, with_bias_grad, num_warps=_NUM_WARPS, programs_per_sm=None):
    """(dy [s, b, np * 3 * hn] contiguous, db [np * 3 * hn] fp32 or None) from dq, dk, dv [s, b, np, hn]
    of any strides whose last is 1: one launch per q, k, v, each over (token programs, heads)."""
    seq, batch, heads, head_dim = dq.shape
    n_tokens, n_cols = seq * batch, heads * 3 * head_dim
    block_d = next_power_of_2(head_dim)
    block_m = max(1, _TILE_ELEMENTS // block_d)
    n_tiles = 3 * heads * cdiv(n_tokens, block_m)
    programs = reduction_programs(dq.device, n_tiles, programs_per_sm or ELEMENTWISE_PROGRAMS_PER_SM)
    grid = (max(1, programs // (3 * heads)), heads)
    out = torch.empty((seq, batch, n_cols), dtype=dq.dtype, device=dq.device)
    partial_sums = torch.empty((grid[0], n_cols) if with_bias_grad else (1,), dtype=torch.float32, device=dq.device)
    for part, grad in enumerate((dq, dk, dv)):
        _pack_qkv_grad_kernel[grid](
            grad, out, partial_sums, n_tokens, batch, head_dim, n_cols, part, *grad.stride()[:3],
            SUM_COLUMNS=with_bias_grad, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps,
        )
    return out, (partial_sums.sum(0) if with_bias_grad else None)


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


class QueryKeyValueSplitFunction(torch.autograd.Function):
    """q, k, v [s, b, np, hn] as views of y [s, b, np * 3 * hn]; backward ``pack_qkv_grads``. ``bias``
    (the projection's, already in y) only receives its gradient here."""

    @staticmethod
    def forward(ctx, mixed, bias, head_dim):
        seq, batch = mixed.shape[:2]
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.set_materialize_grads(False)
        return mixed.view(seq, batch, -1, 3 * head_dim).split(head_dim, dim=-1)

    @staticmethod
    def backward(ctx, grad_query, grad_key, grad_value):
        present = next(g for g in (grad_query, grad_key, grad_value) if g is not None)
        grads = [torch.zeros_like(present) if g is None else _last_dim_contiguous(g)
                 for g in (grad_query, grad_key, grad_value)]
        grad_mixed, grad_bias = pack_qkv_grads(*grads, with_bias_grad=ctx.bias_dtype is not None)
        return grad_mixed, None if grad_bias is None else grad_bias.to(ctx.bias_dtype), None
