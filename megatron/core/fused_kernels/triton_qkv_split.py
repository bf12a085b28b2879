"""Triton backward of the attention's query/key/value split: one pass packs the three gradients and
sums the bias gradient.

The query_key_value projection's output y [s, b, g * (q + 2) * hn] holds, per key/value group j of
the g, its q query heads' rows, then its key's, then its value's ([g, q + 2, hn]; q = 1 is
multi-head attention's per head query, key, value, np = g); attention reads q, k, v out of it.
Backward gets dq [s, b, np = g * q, hn], dk, dv [s, b, g, hn] in whatever layout attention's
backward left them and must hand back

    dy[t, j, i, :] = dq[t, j * q + i, :]  (i < q),  dk[t, j, :]  (i = q),  dv[t, j, :]  (i = q + 1)
    db = sum over t of dy[t]                    (the projection's bias gradient, [g * (q + 2) * hn])

autograd's split backward concatenates (for q > 1 it even fills three zero tensors of dy's size
and adds them) and the projection's backward then reads dy again to sum its rows; here the sum is
taken from registers during the copy. Programs: one launch, a fixed number of programs striding
over the tokens per head (q = 1: each copies the head's q, k and v rows of a tile of tokens into
its 3 * hn contiguous columns) or per row of the g * (q + 2) (q > 1: each copies one query head's,
key's or value's rows into its hn columns), keeping fp32 partial sums, added by torch afterwards.
With dq, dk, dv as cuDNN's attention backward leaves them ([s, b, np, hn], dense) the q = 1 kernel
ran at 0.128 ms against 0.153 for one launch per q, k, v at micro-batch 8 on an H200 (16 heads of
128). For q > 1 the reference's autograd fills three zero tensors of dy's size and adds them: at 32
heads of 64 over 8 groups, micro-batch 8, the backward through autograd took 0.29 ms against the
reference's 0.49 on an H200 (eager, host time included).

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


@triton.jit
def _pack_grouped_qkv_grads_kernel(
    dq_ptr, dk_ptr, dv_ptr, out_ptr, partial_sums_ptr, n_tokens, batch, head_dim, queries, n_cols,
    dq_stride_s, dq_stride_b, dq_stride_h, dk_stride_s, dk_stride_b, dk_stride_h, dv_stride_s, dv_stride_b, dv_stride_h,
    SUM_COLUMNS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Copies the gradient of row program_id(1) of the g * (q + 2) (query head i of group j, its key
    or its value) into its hn contiguous columns of dy. The source is picked by masks: the two
    loads masked off read no memory."""
    program = tl.program_id(0)
    n_programs = tl.num_programs(0)
    slot = tl.program_id(1)
    group = slot // (queries + 2)
    member = slot % (queries + 2)
    query_head = group * queries + tl.minimum(member, queries - 1)
    is_query, is_key, is_value = member < queries, member == queries, member > queries
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    sums = tl.zeros([BLOCK_D], dtype=tl.float32)
    for first_token in range(program * BLOCK_M, n_tokens, n_programs * BLOCK_M):
        tokens = first_token + tl.arange(0, BLOCK_M)  # t = position * b + sequence
        in_bounds = (tokens < n_tokens)[:, None] & dim_ok[None, :]
        positions, sequences = (tokens // batch).to(tl.int64), (tokens % batch).to(tl.int64)
        dq = tl.load(dq_ptr + (positions * dq_stride_s + sequences * dq_stride_b + query_head * dq_stride_h)[:, None]
                     + dims[None, :], mask=in_bounds & is_query, other=0.0)
        dk = tl.load(dk_ptr + (positions * dk_stride_s + sequences * dk_stride_b + group * dk_stride_h)[:, None]
                     + dims[None, :], mask=in_bounds & is_key, other=0.0)
        dv = tl.load(dv_ptr + (positions * dv_stride_s + sequences * dv_stride_b + group * dv_stride_h)[:, None]
                     + dims[None, :], mask=in_bounds & is_value, other=0.0)
        grad = tl.where(is_query, dq, tl.where(is_key, dk, dv))
        out_offsets = tokens.to(tl.int64)[:, None] * n_cols + (slot * head_dim + dims)[None, :]
        tl.store(out_ptr + out_offsets, grad.to(out_ptr.dtype.element_ty), mask=in_bounds)
        if SUM_COLUMNS:
            sums += tl.sum(grad.to(tl.float32), axis=0)
    if SUM_COLUMNS:
        tl.store(partial_sums_ptr + program * n_cols + slot * head_dim + dims, sums, mask=dim_ok)


def pack_qkv_grads(dq, dk, dv, with_bias_grad, num_warps=_NUM_WARPS, programs_per_sm=_PROGRAMS_PER_SM,
                   tile_elements=_TILE_ELEMENTS):
    """(dy [s, b, g * (q + 2) * hn] contiguous, db [g * (q + 2) * hn] fp32 or None) from dq
    [s, b, g * q, hn], dk, dv [s, b, g, hn] of any strides whose last is 1: one launch over (token
    programs, heads) for q = 1, over (token programs, rows of a token's g * (q + 2)) for q > 1."""
    seq, batch, heads, head_dim = dq.shape
    groups = dk.shape[2]
    queries = heads // groups
    slots = groups * (queries + 2)
    n_tokens, n_cols = seq * batch, slots * head_dim
    block_d = next_power_of_2(head_dim)
    block_m = max(1, tile_elements // block_d)
    programs_along = groups if queries == 1 else slots
    n_tiles = programs_along * cdiv(n_tokens, block_m)
    programs = reduction_programs(dq.device, n_tiles, programs_per_sm)
    grid = (max(1, programs // programs_along), programs_along)
    out = torch.empty((seq, batch, n_cols), dtype=dq.dtype, device=dq.device)
    partial_sums = torch.empty((grid[0], n_cols) if with_bias_grad else (1,), dtype=torch.float32, device=dq.device)
    strides = (*dq.stride()[:3], *dk.stride()[:3], *dv.stride()[:3])
    settings = dict(SUM_COLUMNS=with_bias_grad, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps)
    if queries == 1:
        _pack_qkv_grads_kernel[grid](dq, dk, dv, out, partial_sums, n_tokens, batch, head_dim, n_cols, *strides,
                                     **settings)
    else:
        _pack_grouped_qkv_grads_kernel[grid](dq, dk, dv, out, partial_sums, n_tokens, batch, head_dim, queries, n_cols,
                                             *strides, **settings)
    return out, (partial_sums.sum(0) if with_bias_grad else None)


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


class QueryKeyValueSplitFunction(torch.autograd.Function):
    """q [s, b, np, hn], k, v [s, b, g, hn] of y [s, b, g * (q + 2) * hn] (views; the query a copy
    when q = ``queries_per_group`` > 1); backward ``pack_qkv_grads``. ``bias`` (the projection's,
    already in y) only receives its gradient here."""

    @staticmethod
    def forward(ctx, mixed, bias, head_dim, queries_per_group):
        seq, batch = mixed.shape[:2]
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.set_materialize_grads(False)
        if queries_per_group == 1:
            parts = mixed.view(seq, batch, -1, 3 * head_dim).split(head_dim, dim=-1)
        else:
            grouped = mixed.view(seq, batch, -1, queries_per_group + 2, head_dim)  # [s, b, g, q + 2, hn]
            query = grouped[:, :, :, :queries_per_group].reshape(seq, batch, -1, head_dim)
            parts = query, grouped[:, :, :, queries_per_group], grouped[:, :, :, queries_per_group + 1]
        ctx.shapes = [part.shape for part in parts]
        return parts

    @staticmethod
    def backward(ctx, grad_query, grad_key, grad_value):
        present = next(g for g in (grad_query, grad_key, grad_value) if g is not None)
        grads = [present.new_zeros(shape) if g is None else _last_dim_contiguous(g)
                 for g, shape in zip((grad_query, grad_key, grad_value), ctx.shapes)]
        grad_mixed, grad_bias = pack_qkv_grads(*grads, with_bias_grad=ctx.bias_dtype is not None)
        return grad_mixed, None if grad_bias is None else grad_bias.to(ctx.bias_dtype), None, None
