"""Triton backward of the attention's query/key/value split: one pass packs the three gradients and
sums the bias gradient.

The query_key_value projection's output y [s, b, np * 3 * hn] holds, per head j, its query, key and
value rows side by side ([np, 3, hn]); attention reads q, k, v as views of it. Backward gets dq, dk,
dv [s, b, np, hn] in whatever layout attention's backward left them and must hand back

    dy[t, j, i, :] = (dq, dk, dv)[i][t, j, :]   (t a token of the s * b, i in q, k, v)
    db = sum over t of dy[t]                    (the projection's bias gradient, [np * 3 * hn])

autograd's split backward concatenates (a read and a write of dy's size) and the projection's
backward then reads dy again to sum its rows; here the sum is taken from registers during the copy.
Programs: one launch over the heads, a fixed number of programs per head striding over the tokens;
each copies the head's q, k and v rows of a tile of tokens into its 3 * hn contiguous columns and
keeps fp32 partial sums, added by torch afterwards. With dq, dk, dv as cuDNN's attention backward
leaves them ([s, b, np, hn], dense) this ran at 0.128 ms against 0.153 for one launch per q, k, v
at micro-batch 8 on an H200.

This module imports triton; ``selection.kernel_module`` imports it only when a CUDA tensor needs it.
"""
import torch
import triton
import triton.language as tl

from megatron.core.fused_kernels.launch import cdiv, next_power_of_2, reduction_programs

_TILE_ELEMENTS = 8192
_NUM_WARPS = 4
_PROGRAMS_PER_SM = 8


@triton.jit
def _pack_qkv_grads_kernel(
    dq_ptr, dk_ptr, dv_ptr, out_ptr, partial_sums_ptr, n_tokens, batch, head_dim, n_cols,
    dq_stride_s, dq_stride_b, dq_stride_h, dk_stride_s, dk_stride_b, dk_stride_h, dv_stride_s, dv_stride_b, dv_stride_h,
    SUM_COLUMNS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Copies dq, dk, dv of head program_id(1) into its 3 * hn contiguous columns of dy."""
    program = tl.program_id(0)
    n_programs = tl.num_programs(0)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    sums_q = tl.zeros([BLOCK_D], dtype=tl.float32)
    sums_k = tl.zeros([BLOCK_D], dtype=tl.float32)
    sums_v = tl.zeros([BLOCK_D], dtype=tl.float32)
    for first_token in range(program * BLOCK_M, n_tokens, n_programs * BLOCK_M):
        tokens = first_token + tl.arange(0, BLOCK_M)  # t = position * b + sequence
        in_bounds = (tokens < n_tokens)[:, None] & dim_ok[None, :]
        positions, sequences = (tokens // batch).to(tl.int64), (tokens % batch).to(tl.int64)
        out_offsets = tokens.to(tl.int64)[:, None] * n_cols + (head * 3 * head_dim + dims)[None, :]
        dq = tl.load(dq_ptr + (positions * dq_stride_s + sequences * dq_stride_b + head * dq_stride_h)[:, None]
                     + dims[None, :], mask=in_bounds, other=0.0)
        dk = tl.load(dk_ptr + (positions * dk_stride_s + sequences * dk_stride_b + head * dk_stride_h)[:, None]
                     + dims[None, :], mask=in_bounds, other=0.0)
        dv = tl.load(dv_ptr + (positions * dv_stride_s + sequences * dv_stride_b + head * dv_stride_h)[:, None]
                     + dims[None, :], mask=in_bounds, other=0.0)
        tl.store(out_ptr + out_offsets, dq.to(out_ptr.dtype.element_ty), mask=in_bounds)
        tl.store(out_ptr + out_offsets + head_dim, dk.to(out_ptr.dtype.element_ty), mask=in_bounds)
        tl.store(out_ptr + out_offsets + 2 * head_dim, dv.to(out_ptr.dtype.element_ty), mask=in_bounds)
        if SUM_COLUMNS:
            sums_q += tl.sum(dq.to(tl.float32), axis=0)
            sums_k += tl.sum(dk.to(tl.float32), axis=0)
            sums_v += tl.sum(dv.to(tl.float32), axis=0)
    if SUM_COLUMNS:
        row = partial_sums_ptr + program * n_cols + head * 3 * head_dim + dims
        tl.store(row, sums_q, mask=dim_ok)
        tl.store(row + head_dim, sums_k, mask=dim_ok)
        tl.store(row + 2 * head_dim, sums_v, mask=dim_ok)


def pack_qkv_grads(dq, dk, dv, with_bias_grad, num_warps=_NUM_WARPS, programs_per_sm=_PROGRAMS_PER_SM,
                   tile_elements=_TILE_ELEMENTS):
    """(dy [s, b, np * 3 * hn] contiguous, db [np * 3 * hn] fp32 or None) from dq, dk, dv [s, b, np, hn]
    of any strides whose last is 1: one launch over (token programs, heads)."""
    seq, batch, heads, head_dim = dq.shape
    n_tokens, n_cols = seq * batch, heads * 3 * head_dim
    block_d = next_power_of_2(head_dim)
    block_m = max(1, tile_elements // block_d)
    n_tiles = heads * cdiv(n_tokens, block_m)
    programs = reduction_programs(dq.device, n_tiles, programs_per_sm)
    grid = (max(1, programs // heads), heads)
    out = torch.empty((seq, batch, n_cols), dtype=dq.dtype, device=dq.device)
    partial_sums = torch.empty((grid[0], n_cols) if with_bias_grad else (1,), dtype=torch.float32, device=dq.device)
    _pack_qkv_grads_kernel[grid](
        dq, dk, dv, out, partial_sums, n_tokens, batch, head_dim, n_cols,
        *dq.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
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
