"""Triton kernels of a one-token decoding step: the matrix-vector product and attention over a cache.

At batch 1 a decoding step reads every weight once for one row of input, so its time is the time to
stream the weights from memory. cuBLAS's kernels for a [1, K] x [K, N] product leave part of the
bandwidth unused at the GPT layers' shapes (61 % of copy bandwidth for h -> 3h, 33 % for h -> h on
an H200, measured); ``gemv`` spreads the rows of W over many programs, each streaming BLOCK_N rows
in BLOCK_K-column tiles with an fp32 accumulator (49-78 % there, 100 % for the output head).

The GEMV also takes the small operations around the layer's matrix products, so that a decoder
layer at batch 1 is five of these kernels instead of a dozen (each costs a launch and a ramp)::

    y = act(round(N(x)) W^T + b) + r

with the norm N (LayerNorm or RMSNorm, statistics in fp32 over the whole row, recomputed by every
program from the row in cache), the activation act (GeLU, tanh or erf form; or SwiGLU, a * silu(g)
of rows i and N + i of a [2N, K] weight, each program streaming both) and the residual r each
optional.
round() is the rounding to x's dtype of the separate ops: given act or r, x W^T is rounded and the
rest computed in fp32 as the GEMV followed by an elementwise kernel would; a bias alone is added to
the fp32 product, as F.linear does.

On Hopper the kernels launch as programmatic dependents (PDL): a kernel may start while its
predecessor in the stream still runs, streams its first tile of weights (no kernel writes them),
then waits (``gdc_wait``) before reading anything a predecessor wrote; each program signals its
own dependents on entry. On an H100 (tools/benchmarks/bench_decode_layers.py, 24 layers of the
1.3B GPT in one CUDA graph) the layer's kernels took 1222 us with PDL and 1330 without, the layers'
96 GEMVs alone 881 and 992 us (91 % and 81 % of copy bandwidth).

``decode_attention``: one query per (row, head) over a fixed-size cache [b, g, T, hn] of g
key/value groups (head j reads group j // (np / g); g = np is multi-head attention) of which
positions 0 .. p are filled (p: a device scalar, so a captured CUDA graph can replay the step at the
next position)::

    s_t = scale * q . k_t + m_j (t - p)      (ALiBi slope m_j of head j, when given)
    o = sum_t exp(s_t - M) v_t / sum_t exp(s_t - M)       over t = 0 .. p, M = max s

split over chunks of positions as flash-decoding does: a program per (row, head, chunk) reduces its
chunk to (max m_c, sum l_c, weighted values acc_c), reading only filled positions, and a second
kernel combines the chunks with the factors exp(m_c - M). One program per (row, head) walking the
whole cache took 27 us per layer at batch 1 on an H200 (16 programs for 132 SMs). Given the step's
own key and value, the program whose chunk holds p writes them into the cache at p and uses them
there, which saves the two cache-writing kernels. With grouped-query attention the q heads of a
group are neighbouring programs that read the same chunk of the cache (from L2 after the first),
and only the group's first head writes the step's key and value. The query may be read where the
QKV projection's [g, q + 2, hn] rows hold it (head j at group j // q, row j % q), and with the
rotary embedding's inverse frequencies the kernel turns the query and the step's key itself (the
rotation of ``triton_rotary``, rounded once to the input dtype) before using and storing them: a
decoding step's attention is then these two kernels and nothing around them.

This module imports triton; ``selection.kernel_module`` imports it only when a CUDA tensor needs it.
"""
import functools

import torch
import triton
import triton.language as tl

from megatron.core.fused_kernels.launch import cdiv, next_power_of_2
from megatron.core.fused_kernels.triton_elementwise import gelu_tanh

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAS_GRID_DEPENDENCY_CONTROL = True
except ImportError:  # older triton: no PDL, the kernels launch as ordinary ones and never call these
    _HAS_GRID_DEPENDENCY_CONTROL = False
    gdc_launch_dependents = gdc_wait = None

# Two rows of W per program in 1024-column tiles, 4 warps: the best of a sweep over BLOCK_N 2-16,
# BLOCK_K 128-1024 and 2-8 warps at the 1.3B GPT's shapes on an H200, or within 2 % of the best;
# with the fused layer norm and PDL, the best of BLOCK_N 1-4, BLOCK_K 512-2048, 2-8 warps on an H100.
_GEMV_BLOCK_N = 2
_GEMV_MAX_BLOCK_K = 1024
_GEMV_WARPS = 4
# With the layer norm, rows of up to 4096 columns are one tile (x loaded once, statistics from registers)
_GEMV_MAX_NORM_BLOCK_K = 4096
# Attention splits the cache into chunks of 16 positions (more when that makes over 128 chunks), one
# program each per (row, head), so that a batch-1 step still runs hundreds of programs; 2 warps a
# program, 1 when there are 256 (row, head) pairs or more. The best or within 4 % of the best of
# BLOCK_T 16-128 and 1-8 warps at batch 1 and 32 of the 1.3B GPT on an H200.
_ATTENTION_BLOCK_T = 16
_ATTENTION_MAX_CHUNKS = 128
_ATTENTION_MANY_PAIRS = 256
# the GEMV's epilogue activation by name (decode_ops' names) -> the kernel's ACTIVATION code
_ACTIVATION_CODES = {None: 0, "gelu_tanh": 1, "gelu": 2, "swiglu": 3}
# the GEMV's prologue norm by name (decode_ops' names) -> the kernel's NORM code
_NORM_CODES = {None: 0, "layer": 1, "rms": 2}


@functools.lru_cache(maxsize=None)
def _hopper_or_later(device_index):
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def programmatic_launch(tensor: torch.Tensor) -> bool:
    """Whether kernels on ``tensor``'s device launch as programmatic dependents (Hopper and later)."""
    return _HAS_GRID_DEPENDENCY_CONTROL and tensor.is_cuda and _hopper_or_later(tensor.device.index)


@triton.jit
def _enter(PDL: tl.constexpr):
    """Let this kernel's dependents launch, then wait for the predecessors' writes (PDL only)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def _weight_tile(w_ptr, row_offsets, row_ok, cols, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(w_ptr + row_offsets + cols[None, :], mask=row_ok[:, None], other=0.0)
    return tl.load(w_ptr + row_offsets + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)


@triton.jit
def _load_input(x_ptr, cols, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(x_ptr + cols).to(tl.float32)
    return tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)


@triton.jit
def _normalized(x, x_ptr, norm_weight_ptr, norm_bias_ptr, cols, K, mean, rstd, NORM: tl.constexpr):
    """round(N(x)) of the fp32 tile x at cols, given the row's mean (0 for RMSNorm) and 1 / std (or
    1 / rms); 0 past K. LayerNorm (NORM 1) adds its bias, RMSNorm (NORM 2) has none."""
    col_ok = cols < K
    norm_weight = tl.load(norm_weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    normed = (x - mean) * rstd * norm_weight
    if NORM == 1:
        normed += tl.load(norm_bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    normed = tl.where(col_ok, normed, 0.0)
    return normed.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _input_tile(x_ptr, norm_weight_ptr, norm_bias_ptr, cols, K, mean, rstd, NORM: tl.constexpr,
                EVEN_K: tl.constexpr):
    """x[cols] in fp32, or round(N(x))[cols]; 0 past K."""
    x = _load_input(x_ptr, cols, K, EVEN_K)
    if NORM != 0:
        x = _normalized(x, x_ptr, norm_weight_ptr, norm_bias_ptr, cols, K, mean, rstd, NORM)
    return x


@triton.jit
def _row_statistics(x_ptr, K, eps, NORM: tl.constexpr, BLOCK_K: tl.constexpr):
    """(mean, 1 / std) of LayerNorm (NORM 1, two-pass) or (0, 1 / rms) of RMSNorm (NORM 2) over the
    row in memory (in cache: each program reads it), in fp32."""
    cols = tl.arange(0, BLOCK_K)
    mean = 0.0
    if NORM == 1:
        total = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            total += _load_input(x_ptr, start + cols, K, False)
        mean = tl.sum(total, axis=0) / K
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        centered = tl.where(start + cols < K, _load_input(x_ptr, start + cols, K, False) - mean, 0.0)
        squares += centered * centered
    return mean, 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)


@triton.jit
def _first_input_tile(x_ptr, norm_weight_ptr, norm_bias_ptr, K, eps, NORM: tl.constexpr, ONE_TILE: tl.constexpr,
                      EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """(the input's first tile as ``_input_tile``, the row's mean, 1 / std). The statistics are in fp32
    and two-pass for LayerNorm: from the tile itself when it is the whole row, else
    ``_row_statistics``."""
    cols = tl.arange(0, BLOCK_K)
    mean = 0.0
    rstd = 1.0
    if NORM != 0 and ONE_TILE:
        x = _load_input(x_ptr, cols, K, EVEN_K)
        if NORM == 1:
            mean = tl.sum(x, axis=0) / K
        centered = tl.where(cols < K, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / K + eps)
        x = _normalized(x, x_ptr, norm_weight_ptr, norm_bias_ptr, cols, K, mean, rstd, NORM)
    else:
        if NORM != 0:
            mean, rstd = _row_statistics(x_ptr, K, eps, NORM, BLOCK_K)
        x = _input_tile(x_ptr, norm_weight_ptr, norm_bias_ptr, cols, K, mean, rstd, NORM, EVEN_K)
    return x, mean, rstd


@triton.jit
def _epilogue(y, gate, bias_ptr, residual_ptr, y_ptr, rows, row_ok, N, HAS_BIAS: tl.constexpr,
              HAS_RESIDUAL: tl.constexpr, ACTIVATION: tl.constexpr):
    """act(y + b) + r of the fp32 products y (and SwiGLU's gate products, bias rows N + rows)."""
    if ACTIVATION != 0 or HAS_RESIDUAL:  # the separate ops round the product before their elementwise work
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        gate = gate.to(y_ptr.dtype.element_ty).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        if ACTIVATION == 3:
            gate += tl.load(bias_ptr + N + rows, mask=row_ok, other=0.0).to(tl.float32)
    if ACTIVATION == 1:
        y = gelu_tanh(y)
    elif ACTIVATION == 2:
        y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
    elif ACTIVATION == 3:
        y = y * gate / (1.0 + tl.exp(-gate))
    if HAS_RESIDUAL:
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32) + tl.load(residual_ptr + rows, mask=row_ok,
                                                                    other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, residual_ptr, norm_weight_ptr, norm_bias_ptr, y_ptr, N, K, eps,
                 HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM: tl.constexpr, ACTIVATION: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ONE_TILE: tl.constexpr,
                 PDL: tl.constexpr):
    """Rows program_id * BLOCK_N + [0, BLOCK_N) of y = act(round(N(x)) W^T + b) + r (module docstring);
    with SwiGLU (ACTIVATION 3) also rows N + those of W, the gate's."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    row_offsets = rows[:, None].to(tl.int64) * K
    gate_offsets = (rows + N)[:, None].to(tl.int64) * K
    cols = tl.arange(0, BLOCK_K)
    w = _weight_tile(w_ptr, row_offsets, row_ok, cols, K, EVEN_K)  # before the wait: weights are no kernel's output
    w_gate = w
    if ACTIVATION == 3:
        w_gate = _weight_tile(w_ptr, gate_offsets, row_ok, cols, K, EVEN_K)
    _enter(PDL)
    x, mean, rstd = _first_input_tile(x_ptr, norm_weight_ptr, norm_bias_ptr, K, eps, NORM, ONE_TILE, EVEN_K, BLOCK_K)
    acc = w.to(tl.float32) * x[None, :]
    acc_gate = w_gate.to(tl.float32) * x[None, :]
    for start in range(BLOCK_K, K, BLOCK_K):
        tile = start + cols
        x_tile = _input_tile(x_ptr, norm_weight_ptr, norm_bias_ptr, tile, K, mean, rstd, NORM, EVEN_K)[None, :]
        acc += _weight_tile(w_ptr, row_offsets, row_ok, tile, K, EVEN_K).to(tl.float32) * x_tile
        if ACTIVATION == 3:
            acc_gate += _weight_tile(w_ptr, gate_offsets, row_ok, tile, K, EVEN_K).to(tl.float32) * x_tile
    _epilogue(tl.sum(acc, axis=1), tl.sum(acc_gate, axis=1), bias_ptr, residual_ptr, y_ptr, rows, row_ok, N,
              HAS_BIAS, HAS_RESIDUAL, ACTIVATION)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None = None,
         norm: tuple[str, torch.Tensor, torch.Tensor | None, float] | None = None,
         activation: str | None = None) -> torch.Tensor:
    """x [..., K] holding one row, weight [M, K] contiguous, bias [M] or None, residual [..., N]
    (contiguous) or None, norm = (kind "layer" or "rms", weight [K], bias [K] or None for "rms", eps)
    of a norm of x, or None -> act(round(N(x)) W^T + b) + r [..., N] in x's dtype; N = M, or M / 2
    with "swiglu" (a * silu(g) of the first and second halves of the rows)."""
    m, k = weight.shape
    n = m // 2 if activation == "swiglu" else m
    row = x.reshape(k).contiguous()
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    kind, norm_weight, norm_bias, eps = norm if norm is not None else (None, row, row, 0.0)
    block_k = next_power_of_2(k)
    if norm is None or block_k > _GEMV_MAX_NORM_BLOCK_K:
        block_k = min(_GEMV_MAX_BLOCK_K, block_k)
    pdl = programmatic_launch(x)
    _gemv_kernel[(cdiv(n, _GEMV_BLOCK_N),)](
        row, weight, y if bias is None else bias, y if residual is None else residual, norm_weight,
        row if norm_bias is None else norm_bias, y, n, k, eps, HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, NORM=_NORM_CODES[kind], ACTIVATION=_ACTIVATION_CODES[activation],
        BLOCK_N=_GEMV_BLOCK_N, BLOCK_K=block_k, EVEN_K=k % block_k == 0, ONE_TILE=block_k >= k, PDL=pdl,
        num_warps=_GEMV_WARPS, **_launch_options(pdl))
    return y.view(*x.shape[:-1], n)


def _launch_options(pdl):
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def _head_vector(ptr, dims, dim_ok, angle_position, inv_freq_ptr, half, ROTARY: tl.constexpr):
    """The head vector at ptr [BLOCK_D] in ptr's dtype; with ROTARY turned by the rotary embedding at
    angle_position (fp32) as triton_rotary turns it: the first 2 * half channels in pairs (i, i + half)
    at angles angle_position * inv_freq[i], fp32 math, one rounding."""
    x = tl.load(ptr + dims, mask=dim_ok, other=0.0)
    if ROTARY:
        first = dims < half
        rotated = dims < 2 * half
        partner = tl.load(ptr + tl.where(first, dims + half, dims - half), mask=rotated, other=0.0).to(tl.float32)
        angle = angle_position * tl.load(inv_freq_ptr + tl.where(first, dims, dims - half), mask=rotated, other=0.0)
        x32 = x.to(tl.float32)
        cos, sin = tl.cos(angle), tl.sin(angle)
        turned = tl.where(first, x32 * cos - partner * sin, x32 * cos + partner * sin)
        x = tl.where(rotated, turned, x32).to(ptr.dtype.element_ty)
    return x


@triton.jit
def _decode_attention_chunk_kernel(q_ptr, k_ptr, v_ptr, new_k_ptr, new_v_ptr, position_ptr, slopes_ptr, partial_ptr,
                                   stats_ptr, rotary_positions_ptr, inv_freq_ptr, heads, queries, head_dim, capacity,
                                   q_stride_b, q_stride_g, q_stride_h, new_stride_b, new_stride_h, kv_stride_b,
                                   kv_stride_h, kv_stride_t, rotary_positions_stride, rotary_half, scale,
                                   HAS_ALIBI: tl.constexpr, WRITE: tl.constexpr, ROTARY: tl.constexpr,
                                   BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    """Chunk c of (row, head) = program (0, 1): max m_c, sum l_c and sum_t exp(s_t - m_c) v_t over its
    filled positions (none: m_c = -inf, l_c = 0, no memory read). Head j's query is at
    row * q_stride_b + (j // queries) * q_stride_g + (j % queries) * q_stride_h. With WRITE the
    step's own key and value (at p) come from new_k, new_v, and the program holding p stores them
    into the cache (the first of the group's ``queries`` heads; the others use them from registers).
    With ROTARY (and WRITE) the query and the step's key are first turned by the rotary embedding at
    the row's position rotary_positions[row * rotary_positions_stride]."""
    _enter(PDL)
    program = tl.program_id(0)  # row * heads + head
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    row = program // heads
    head = program % heads
    group = head // queries
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    angle_position = 0.0
    if ROTARY:
        angle_position = tl.load(rotary_positions_ptr + row * rotary_positions_stride).to(tl.float32)
    q = _head_vector(q_ptr + row * q_stride_b + group * q_stride_g + (head % queries) * q_stride_h, dims, dim_ok,
                     angle_position, inv_freq_ptr, rotary_half, ROTARY).to(tl.float32)
    position = tl.load(position_ptr)
    t = chunk * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = (t <= position) & (t < capacity)
    offsets = row.to(tl.int64) * kv_stride_b + group * kv_stride_h + t[:, None] * kv_stride_t + dims[None, :]
    tile_ok = valid[:, None] & dim_ok[None, :]
    if WRITE:
        new_offset = row * new_stride_b + group * new_stride_h
        is_new = (t == position)[:, None] & dim_ok[None, :]
        cached = tile_ok & ~is_new
        keys = tl.load(k_ptr + offsets, mask=cached, other=0.0)
        values = tl.load(v_ptr + offsets, mask=cached, other=0.0)
        new_key = _head_vector(new_k_ptr + new_offset, dims, dim_ok, angle_position, inv_freq_ptr, rotary_half, ROTARY)
        keys = tl.where(is_new, new_key[None, :], keys)
        values = tl.where(is_new, tl.load(new_v_ptr + new_offset + dims, mask=dim_ok, other=0.0)[None, :], values)
        writer = is_new & (head % queries == 0)
        tl.store(k_ptr + offsets, keys, mask=writer)
        tl.store(v_ptr + offsets, values, mask=writer)
    else:
        keys = tl.load(k_ptr + offsets, mask=tile_ok, other=0.0)
        values = tl.load(v_ptr + offsets, mask=tile_ok, other=0.0)
    scores = tl.sum(keys.to(tl.float32) * q[None, :], axis=1) * scale  # [BLOCK_T]
    if HAS_ALIBI:
        scores += tl.load(slopes_ptr + head).to(tl.float32) * (t - position).to(tl.float32)
    scores = tl.where(valid, scores, float("-inf"))
    chunk_max = tl.max(scores, axis=0)
    weights = tl.exp(scores - tl.where(chunk_max == float("-inf"), 0.0, chunk_max))
    slot = program * chunks + chunk
    tl.store(partial_ptr + slot * BLOCK_D + dims, tl.sum(weights[:, None] * values.to(tl.float32), axis=0))
    tl.store(stats_ptr + slot * 2, chunk_max)
    tl.store(stats_ptr + slot * 2 + 1, tl.sum(weights, axis=0))


@triton.jit
def _decode_attention_combine_kernel(partial_ptr, stats_ptr, out_ptr, chunks, head_dim, BLOCK_C: tl.constexpr,
                                     BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """o = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c with M = max_c m_c (finite: chunk 0 holds p = 0)."""
    _enter(PDL)
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
                     slopes: torch.Tensor | None, scale: float, new_key: torch.Tensor | None = None,
                     new_value: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
                     rotary_positions: torch.Tensor | None = None) -> torch.Tensor:
    """query [b, np, 1, hn], or [b, g, q, 1, hn] with q = np / g (the grouped rows of the QKV
    projection, uncopied), the last dim contiguous; keys/values [b, g, T, hn] contiguous (g dividing
    np), position: one int64 element (p), slopes [np] or None -> [b, np, 1, hn] in the query's dtype.
    new_key, new_value [b, g, 1, hn] (of equal strides, the last dim contiguous, the cache's dtype),
    or None: the step's key and value, written into the cache at p here (else the cache holds them
    already). inv_freq [d / 2] fp32 and rotary_positions [b] or [1] (integers, any stride), with new_key:
    the query and new_key are given before the rotary embedding, which the kernel applies."""
    batch, groups, capacity, head_dim = keys.shape
    heads = query.shape[1] * (query.shape[2] if query.dim() == 5 else 1)
    queries = heads // groups
    q_stride_b, q_stride_g, q_stride_h = ((query.stride(0), query.stride(1), query.stride(2)) if query.dim() == 5
                                          else (query.stride(0), queries * query.stride(1), query.stride(1)))
    block_t = max(_ATTENTION_BLOCK_T, next_power_of_2(cdiv(capacity, _ATTENTION_MAX_CHUNKS)))
    chunks, block_d = cdiv(capacity, block_t), next_power_of_2(head_dim)
    partial = torch.empty(batch * heads, chunks, block_d, dtype=torch.float32, device=query.device)
    stats = torch.empty(batch * heads, chunks, 2, dtype=torch.float32, device=query.device)
    write, rotary = new_key is not None, inv_freq is not None
    new_key, new_value = (new_key, new_value) if write else (query, query)
    inv_freq, rotary_positions = (inv_freq, rotary_positions) if rotary else (partial, position)
    pdl = programmatic_launch(query)
    _decode_attention_chunk_kernel[(batch * heads, chunks)](
        query, keys, values, new_key, new_value, position, keys if slopes is None else slopes, partial, stats,
        rotary_positions, inv_freq, heads, queries, head_dim, capacity, q_stride_b, q_stride_g, q_stride_h,
        new_key.stride(0), new_key.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        rotary_positions.stride(0) if rotary_positions.numel() > 1 else 0, inv_freq.numel() if rotary else 0, scale,
        HAS_ALIBI=slopes is not None, WRITE=write, ROTARY=rotary, BLOCK_D=block_d, BLOCK_T=block_t, PDL=pdl,
        num_warps=1 if batch * heads >= _ATTENTION_MANY_PAIRS else 2, **_launch_options(pdl))
    out = torch.empty(batch, heads, 1, head_dim, dtype=query.dtype, device=query.device)
    _decode_attention_combine_kernel[(batch * heads,)](partial, stats, out, chunks, head_dim,
                                                       BLOCK_C=next_power_of_2(chunks), BLOCK_D=block_d, PDL=pdl,
                                                       **_launch_options(pdl))
    return out
