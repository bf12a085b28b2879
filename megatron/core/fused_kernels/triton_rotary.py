"""Triton rotary embedding of the query and the key in one launch, angles computed in the kernel.

For a head vector x [hn] at position p, with theta = inv_freq [d / 2] (d <= hn rotated channels) and
the angle a_i = float32(p) * theta_i (one fp32 product, as ``rotary_cos_sin`` forms it):
    out[i]         = x[i] cos a_i - x[i + d/2] sin a_i       i < d / 2
    out[i + d/2]   = x[i + d/2] cos a_i + x[i] sin a_i
    out[j]         = x[j]                                    d <= j < hn
in fp32, rounded once to the input dtype. The backward is the same map at the angle -a_i (the
rotation's transpose): cos is even and sin odd, so it flips the sign of sin.

Forward reads q [s, b, nq, hn] and k [s, b, nk, hn] through their strides (views of the
query_key_value output are fine; the last stride must be 1) and writes new contiguous tensors, in
the [b, heads, s, hn] layout attention takes (``batch_first``) or [s, b, heads, hn]. Backward reads
the incoming gradients through their strides and writes dq, dk [s, b, heads, hn] contiguous.
No [s, b, 1, d] cos/sin tensors exist: each program takes the positions of a block of BLOCK_S tokens
of one sequence, computes their cos and sin once in registers and applies them to its share of
the nq + nk heads (every ``head_splits``-th head, q's then k's). On NVIDIA GPUs ``tl.cos`` and
``tl.sin`` compile to libdevice's ``__nv_cosf`` / ``__nv_sinf`` (full range reduction, as torch's
CUDA cos and sin), not to the ``cos.approx`` instructions, so long positions keep their accuracy.

This module imports triton; ``selection.kernel_module`` imports it only when a CUDA tensor needs it.
"""
import torch
import triton
import triton.language as tl

from megatron.core.fused_kernels.launch import cdiv, next_power_of_2

_TILE_ELEMENTS = 2048
_HEAD_SPLITS = 4
_NUM_WARPS = 4


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, first_head, n_heads, head_step, tokens_ok, src_token, dst_token,
                  src_stride_h, dst_stride_h, cos, sin, half, head_dim,
                  BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    """Rotates heads first_head, first_head + head_step, ... < n_heads of a [BLOCK_S] block of tokens
    whose head 0 starts at src_token / dst_token (element offsets [BLOCK_S, 1])."""
    pairs = tl.arange(0, BLOCK_HALF)[None, :]
    pair_ok = tokens_ok & (pairs < half)
    for head in range(first_head, n_heads, head_step):
        src = src_ptr + src_token + head * src_stride_h
        dst = dst_ptr + dst_token + head * dst_stride_h
        x1 = tl.load(src + pairs, mask=pair_ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + half + pairs, mask=pair_ok, other=0.0).to(tl.float32)
        tl.store(dst + pairs, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=pair_ok)
        tl.store(dst + half + pairs, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=pair_ok)
        if BLOCK_REST > 0:
            rest = 2 * half + tl.arange(0, BLOCK_REST)[None, :]
            rest_ok = tokens_ok & (rest < head_dim)
            tl.store(dst + rest, tl.load(src + rest, mask=rest_ok, other=0.0).to(dst_ptr.dtype.element_ty),
                     mask=rest_ok)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, inv_freq_ptr,
    seq, n_q_heads, n_k_heads, half, head_dim,
    q_stride_s, q_stride_b, q_stride_h, k_stride_s, k_stride_b, k_stride_h,
    q_out_stride_s, q_out_stride_b, q_out_stride_h, k_out_stride_s, k_out_stride_b, k_out_stride_h,
    positions_stride_b, positions_stride_s,
    INVERSE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
):
    """Program (token block program_id(0), sequence program_id(1), head share program_id(2))."""
    sequence = tl.program_id(1)
    head_split = tl.program_id(2)
    head_splits = tl.num_programs(2)
    tokens = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    tokens_ok = (tokens < seq)[:, None]
    pairs = tl.arange(0, BLOCK_HALF)
    positions = tl.load(positions_ptr + sequence * positions_stride_b + tokens * positions_stride_s,
                        mask=tokens < seq, other=0).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + pairs, mask=pairs < half, other=0.0)
    angles = positions[:, None] * inv_freq[None, :]  # [BLOCK_S, BLOCK_HALF]
    cos = tl.cos(angles)
    sin = tl.sin(angles)
    if INVERSE:
        sin = -sin
    tokens64 = tokens.to(tl.int64)[:, None]
    sequence64 = sequence.to(tl.int64)
    _rotate_heads(q_ptr, q_out_ptr, head_split, n_q_heads, head_splits, tokens_ok,
                  tokens64 * q_stride_s + sequence64 * q_stride_b,
                  tokens64 * q_out_stride_s + sequence64 * q_out_stride_b,
                  q_stride_h, q_out_stride_h, cos, sin, half, head_dim, BLOCK_HALF, BLOCK_REST)
    _rotate_heads(k_ptr, k_out_ptr, head_split, n_k_heads, head_splits, tokens_ok,
                  tokens64 * k_stride_s + sequence64 * k_stride_b,
                  tokens64 * k_out_stride_s + sequence64 * k_out_stride_b,
                  k_stride_h, k_out_stride_h, cos, sin, half, head_dim, BLOCK_HALF, BLOCK_REST)


def _token_strides(t, batch_first):
    """t's strides in the order (s, b, head) for t [b, heads, s, hn] (batch_first) or [s, b, heads, hn]."""
    stride = t.stride()
    return (stride[2], stride[0], stride[1]) if batch_first else stride[:3]


def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def rotate(q, k, positions, inv_freq, *, inverse, in_batch_first, out_batch_first, block_s=None,
           head_splits=_HEAD_SPLITS, num_warps=_NUM_WARPS):
    """(q', k') rotated at the angles positions x inv_freq (their negatives when ``inverse``).

    q [.., nq, hn], k [.., nk, hn] in the [b, heads, s, hn] (``in_batch_first``) or [s, b, heads, hn]
    layout, any strides; positions [b or 1, s] integers; inv_freq [d / 2] fp32. The outputs are new
    contiguous tensors in the layout ``out_batch_first`` names, in q's and k's dtypes."""
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    if in_batch_first:
        batch, n_q_heads, seq, head_dim = q.shape
    else:
        seq, batch, n_q_heads, head_dim = q.shape
    n_k_heads = k.shape[1] if in_batch_first else k.shape[2]
    half = inv_freq.shape[0]
    shapes = [(batch, n, seq, head_dim) if out_batch_first else (seq, batch, n, head_dim)
              for n in (n_q_heads, n_k_heads)]
    q_out = torch.empty(shapes[0], dtype=q.dtype, device=q.device)
    k_out = torch.empty(shapes[1], dtype=k.dtype, device=k.device)
    positions = positions.expand(batch, seq)
    block_half = next_power_of_2(half)
    rest = head_dim - 2 * half
    block_s = block_s or max(1, _TILE_ELEMENTS // (2 * block_half))
    grid = (cdiv(seq, block_s), batch, max(1, min(head_splits, n_q_heads + n_k_heads)))
    _rotary_kernel[grid](
        q, k, q_out, k_out, positions, inv_freq, seq, n_q_heads, n_k_heads, half, head_dim,
        *_token_strides(q, in_batch_first), *_token_strides(k, in_batch_first),
        *_token_strides(q_out, out_batch_first), *_token_strides(k_out, out_batch_first),
        positions.stride(0), positions.stride(1),
        INVERSE=inverse, BLOCK_S=block_s, BLOCK_HALF=block_half, BLOCK_REST=next_power_of_2(rest) if rest else 0,
        num_warps=num_warps,
    )
    return q_out, k_out


class RotaryEmbeddingFunction(torch.autograd.Function):
    """Autograd wrapper over ``rotate``: query [s, b, nq, hn], key [s, b, nk, hn] (any strides) ->
    contiguous [b, heads, s, hn] (``batch_first``) or [s, b, heads, hn]; gradients [s, b, heads, hn]
    contiguous. position_ids [b or 1, s] and inv_freq [d / 2] (fp32) get no gradient."""

    @staticmethod
    def forward(ctx, query, key, position_ids, inv_freq, batch_first):
        ctx.save_for_backward(position_ids, inv_freq)
        ctx.batch_first = batch_first
        return rotate(query, key, position_ids, inv_freq, inverse=False, in_batch_first=False,
                      out_batch_first=batch_first)

    @staticmethod
    def backward(ctx, grad_query, grad_key):
        position_ids, inv_freq = ctx.saved_tensors
        grad_q, grad_k = rotate(grad_query, grad_key, position_ids, inv_freq, inverse=True,
                                in_batch_first=ctx.batch_first, out_batch_first=False)
        return grad_q, grad_k, None, None, None
