"""Triton kernels of a one-token decoding step: the matrix-vector product and attention over a cache.

At batch 1 a decoding step reads every weight once for one row of input, so its time is the time to
stream the weights from memory. cuBLAS's kernels for a [1, K] x [K, N] product leave part of the
bandwidth unused at the GPT layers' shapes (61 % of copy bandwidth for h -> 3h, 33 % for h -> h on
an H200, measured); ``gemv`` spreads the rows of W over many programs, each streaming BLOCK_N rows
in BLOCK_K-column tiles with an fp32 accumulator (49-78 % there, 100 % for the output head).

``decode_attention``: one query per (row, head) over a fixed-size cache [b, np, T, hn] of which
positions 0 .. p are filled (p: a device scalar, so a captured CUDA graph can replay the step at the
next position)::

    s_t = scale * q . k_t + m_j (t - p)      (ALiBi slope m_j of head j, when given)
    o = sum_t exp(s_t - M) v_t / sum_t exp(s_t - M)       over t = 0 .. p, M = max s

split over chunks of positions as flash-decoding does: a program per (row, head, chunk) reduces its
chunk to (max m_c, sum l_c, weighted values acc_c), reading only filled positions, and a second
kernel combines the chunks with the factors exp(m_c - M). One program per (row, head) walking the
whole cache took 27 us per layer at batch 1 on an H200 (16 programs for 132 SMs).

This module imports triton; ``dispatch`` imports it only when a CUDA tensor needs it.
"""
import torch
import triton
import triton.language as tl

from megatron.core.fused_kernels.launch import cdiv, next_power_of_2

# Two rows of W per program in 1024-column tiles, 4 warps: the best of a sweep over BLOCK_N 2-16,
# BLOCK_K 128-1024 and 2-8 warps at the 1.3B GPT's shapes on an H200, or within 2 % of the best.
_GEMV_BLOCK_N = 2
_GEMV_MAX_BLOCK_K = 1024
_GEMV_WARPS = 4
# Attention splits the cache into chunks of 16 positions (more when that makes over 128 chunks), one
# program each per (row, head), so that a batch-1 step still runs hundreds of programs; 2 warps a
# program, 1 when there are 256 (row, head) pairs or more. The best or within 4 % of the best of
# BLOCK_T 16-128 and 1-8 warps at batch 1 and 32 of the 1.3B GPT on an H200.
_ATTENTION_BLOCK_T = 16
_ATTENTION_MAX_CHUNKS = 128
_ATTENTION_MANY_PAIRS = 256


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, N, K, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    row_offsets = rows[:, None].to(tl.int64) * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_ptr + row_offsets + cols[None, :], mask=row_ok[:, None], other=0.0)
            x = tl.load(x_ptr + cols)
        else:
            col_ok = cols < K
            w = tl.load(w_ptr + row_offsets + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] holding one row, weight [N, K] contiguous, bias [N] or None -> x W^T + b [..., N]."""
    n, k = weight.shape
    row = x.reshape(k).contiguous()
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    block_k = min(_GEMV_MAX_BLOCK_K, next_power_of_2(k))
    _gemv_kernel[(cdiv(n, _GEMV_BLOCK_N),)](
        row, weight, y if bias is None else bias, y, n, k, HAS_BIAS=bias is not None, BLOCK_N=_GEMV_BLOCK_N,
        BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=_GEMV_WARPS)
    return y.view(*x.shape[:-1], n)


@triton.jit
def _decode_attention_chunk_kernel(q_ptr, k_ptr, v_ptr, position_ptr, slopes_ptr, partial_ptr, stats_ptr, heads,
                                   head_dim, capacity, q_stride_b, q_stride_h, kv_stride_b, kv_stride_h, kv_stride_t,
                                   scale, HAS_ALIBI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Chunk c of (row, head) = program (0, 1): max m_c, sum l_c and sum_t exp(s_t - m_c) v_t over its
    filled positions (none: m_c = -inf, l_c = 0, no memory read)."""
    program = tl.program_id(0)  # row * heads + head
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    row = program // heads
    head = program % heads
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q = tl.load(q_ptr + row * q_stride_b + head * q_stride_h + dims, mask=dim_ok, other=0.0).to(tl.float32)
    position = tl.load(position_ptr)
    t = chunk * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = (t <= position) & (t < capacity)
    offsets = row.to(tl.int64) * kv_stride_b + head * kv_stride_h + t[:, None] * kv_stride_t + dims[None, :]
    tile_ok = valid[:, None] & dim_ok[None, :]
    keys = tl.load(k_ptr + offsets, mask=tile_ok, other=0.0).to(tl.float32)
    values = tl.load(v_ptr + offsets, mask=tile_ok, other=0.0).to(tl.float32)
    scores = tl.sum(keys * q[None, :], axis=1) * scale  # [BLOCK_T]
    if HAS_ALIBI:
        scores += tl.load(slopes_ptr + head).to(tl.float32) * (t - position).to(tl.float32)
    scores = tl.where(valid, scores, float("-inf"))
    chunk_max = tl.max(scores, axis=0)
    weights = tl.exp(scores - tl.where(chunk_max == float("-inf"), 0.0, chunk_max))
    slot = program * chunks + chunk
    tl.store(partial_ptr + slot * BLOCK_D + dims, tl.sum(weights[:, None] * values, axis=0))
    tl.store(stats_ptr + slot * 2, chunk_max)
    tl.store(stats_ptr + slot * 2 + 1, tl.sum(weights, axis=0))


@triton.jit
def _decode_attention_combine_kernel(partial_ptr, stats_ptr, out_ptr, chunks, head_dim, BLOCK_C: tl.constexpr,
                                     BLOCK_D: tl.constexpr):
    """o = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c with M = max_c m_c (finite: chunk 0 holds p = 0)."""
    program = tl.program_id(0)
    chunk = tl.arange(0, BLOCK_C)
    chunk_ok = chunk < chunks
    dims = tl.arange(0, BLOCK_D)
    slots = program * chunks + chunk
    maxima = tl.load(stats_ptr + slots * 2, mask=chunk_ok, other=float("-inf"))
    sums = tl.load(stats_ptr + slots * 2 + 1, mask=chunk_ok, other=0.0)
    factors = tl.exp(maxima - tl.max(maxima, axis=0))  # [BLOCK_C], 0 for the empty chunks
    partial = tl.load(partial_ptr + slots[:, None] * BLOCK_D + dims[None, :], mask=chunk_ok[:, None], other=0.0)
    out = tl.sum(partial * factors[:, None], axis=0) / tl.sum(sums * factors, axis=0)
    tl.store(out_ptr + program * head_dim + dims, out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor,
                     slopes: torch.Tensor | None, scale: float) -> torch.Tensor:
    """query [b, np, 1, hn] (last dim contiguous), keys/values [b, np, T, hn] contiguous, position:
    one int64 element (p), slopes [np] or None -> [b, np, 1, hn] in the query's dtype."""
    batch, heads, _, head_dim = query.shape
    capacity = keys.shape[2]
    block_t = max(_ATTENTION_BLOCK_T, next_power_of_2(cdiv(capacity, _ATTENTION_MAX_CHUNKS)))
    chunks, block_d = cdiv(capacity, block_t), next_power_of_2(head_dim)
    partial = torch.empty(batch * heads, chunks, block_d, dtype=torch.float32, device=query.device)
    stats = torch.empty(batch * heads, chunks, 2, dtype=torch.float32, device=query.device)
    _decode_attention_chunk_kernel[(batch * heads, chunks)](
        query, keys, values, position, keys if slopes is None else slopes, partial, stats, heads, head_dim, capacity,
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), scale,
        HAS_ALIBI=slopes is not None, BLOCK_D=block_d, BLOCK_T=block_t,
        num_warps=1 if batch * heads >= _ATTENTION_MANY_PAIRS else 2)
    out = torch.empty(batch, heads, 1, head_dim, dtype=query.dtype, device=query.device)
    _decode_attention_combine_kernel[(batch * heads,)](partial, stats, out, chunks, head_dim,
                                                       BLOCK_C=next_power_of_2(chunks), BLOCK_D=block_d)
    return out
