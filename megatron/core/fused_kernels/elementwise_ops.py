"""SwiGLU and the rotary embedding of a Llama-style layer: each a Triton kernel (forward and backward)
or its plain-torch reference.

``swiglu(x)``: x [..., 2n] = [a | g] -> a * silu(g) [..., n], the gated MLP's activation.
``rotary_embedding(query, key, position_ids, inv_freq, batch_first=True)``: the GPT-NeoX / Llama
rotary embedding (half rotation of the first d = 2 len(inv_freq) channels of each head, angles
float32(p) * inv_freq in fp32, the rest passed through) of the query and the key at once.

As with ``training_ops``, each op checks its arguments (FusedKernelArgumentError), then
``selection.fused_or_reference`` picks the kernel (``triton_swiglu``, ``triton_rotary``) on CUDA when
its constraints (``*_constraint_violation``) hold, and the reference here otherwise; CPU tensors and
torch.compile always take the reference.
"""
import torch
import torch.nn.functional as F

from megatron.core.fused_kernels.selection import FusedKernelArgumentError, dtype_violation, fused_or_reference

MAX_SWIGLU_NUMEL = 2**31 - 1  # the kernel's column offsets are int32 (its row offsets int64)
MAX_ROTARY_NUMEL = 2**31 - 1  # the rotary kernel's head offsets are int32 (its token offsets int64)


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    """a * silu(g) for x [..., 2n] = [a | g] (a the first half of the last dim) -> [..., n], in torch."""
    linear, gate = x.chunk(2, dim=-1)
    return linear * F.silu(gate)


def rotary_cos_sin_reference(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of the angles float32(p) * inv_freq repeated twice, fp32 [s, b, 1, d], of position_ids
    [b, s] and inv_freq [d / 2]."""
    angles = position_ids.t().to(torch.float32)[..., None] * inv_freq.to(position_ids.device)  # [s, b, d / 2]
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]  # [s, b, 1, d]
    return angles.cos(), angles.sin()


def _rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x cos + [-x2, x1] sin on the first d channels of x [s, b, heads, hn] in fp32, cast back."""
    dim = cos.shape[-1]
    rotated, passed = (x, None) if dim == x.shape[-1] else (x[..., :dim], x[..., dim:])
    x32 = rotated.to(torch.float32)
    x1, x2 = x32.chunk(2, dim=-1)
    out = (x32 * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)
    return out if passed is None else torch.cat((out, passed), dim=-1)


def rotary_embedding_reference(query: torch.Tensor, key: torch.Tensor, position_ids: torch.Tensor,
                               inv_freq: torch.Tensor, batch_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding of query [s, b, nq, hn] and key [s, b, nk, hn] in torch; returns views in
    the [b, heads, s, hn] layout (``batch_first``) or tensors [s, b, heads, hn]."""
    cos, sin = rotary_cos_sin_reference(position_ids, inv_freq)
    query, key = _rotate_reference(query, cos, sin), _rotate_reference(key, cos, sin)
    if batch_first:
        return query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3)
    return query, key


def swiglu_constraint_violation(x: torch.Tensor) -> str | None:
    """Why the Triton SwiGLU cannot take x on any device, or None."""
    if x.numel() == 0 or x.numel() > MAX_SWIGLU_NUMEL:
        return f"{x.numel()} elements, the kernel takes 1 to {MAX_SWIGLU_NUMEL}"
    return dtype_violation("x", x)


def rotary_constraint_violation(query: torch.Tensor, key: torch.Tensor, position_ids: torch.Tensor,
                                inv_freq: torch.Tensor) -> str | None:
    """Why the Triton rotary embedding cannot take these tensors on any device, or None."""
    if query.numel() == 0 or key.numel() == 0:
        return "query or key is empty"
    if max(query.numel(), key.numel()) > MAX_ROTARY_NUMEL:
        return f"query or key has more than {MAX_ROTARY_NUMEL} elements"
    if inv_freq.dtype != torch.float32:
        return f"inv_freq has dtype {inv_freq.dtype}, the kernel takes fp32"
    if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
        return f"position_ids have dtype {position_ids.dtype}, the kernel takes integers"
    if key.dtype != query.dtype:
        return f"key has dtype {key.dtype} != query's {query.dtype}"
    return dtype_violation("query", query)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """y = a * silu(g) for x [..., 2n], a = x[..., :n], g = x[..., n:] -> y [..., n] in x's dtype.

    On the Triton path (triton_swiglu) the math is fp32 with one rounding, x is the only tensor kept
    for backward, and dx [..., 2n] is written by one kernel; the reference is torch's
    ``a * F.silu(g)`` (its product rounded in x's dtype)."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise FusedKernelArgumentError(f"swiglu: the last dim of x must be even ([..., 2n] = [a | g]), got "
                                       f"shape {tuple(x.shape)}")
    return fused_or_reference(
        "triton_swiglu", (x,), lambda: swiglu_constraint_violation(x),
        lambda kernels: kernels.SwiGLUFunction.apply(x), lambda: swiglu_reference(x))


def _check_rotary_arguments(query, key, position_ids, inv_freq):
    if query.dim() != 4 or key.dim() != 4:
        raise FusedKernelArgumentError(f"rotary_embedding: query and key must be [s, b, heads, hn], got "
                                       f"{tuple(query.shape)} and {tuple(key.shape)}")
    seq, batch, _, head_dim = query.shape
    if (key.shape[0], key.shape[1], key.shape[3]) != (seq, batch, head_dim):
        raise FusedKernelArgumentError(f"rotary_embedding: key {tuple(key.shape)} does not match query "
                                       f"{tuple(query.shape)} in s, b or hn")
    if position_ids.dim() != 2 or position_ids.shape[1] != seq or position_ids.shape[0] not in (1, batch):
        raise FusedKernelArgumentError(f"rotary_embedding: position_ids must be [b, s] or [1, s] (b = {batch}, "
                                       f"s = {seq} of query {tuple(query.shape)}), got {tuple(position_ids.shape)}")
    if inv_freq.dim() != 1 or not 1 <= 2 * inv_freq.shape[0] <= head_dim:
        raise FusedKernelArgumentError(f"rotary_embedding: inv_freq must be [d / 2] with 2 <= d <= hn = {head_dim}, "
                                       f"got {tuple(inv_freq.shape)}")


def rotary_embedding(query: torch.Tensor, key: torch.Tensor, position_ids: torch.Tensor, inv_freq: torch.Tensor,
                     batch_first: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding of query [s, b, nq, hn] and key [s, b, nk, hn] (any strides, e.g. views of
    the query_key_value output; nk may differ from nq) at position_ids [b or 1, s] (integers) with
    inv_freq [d / 2], d <= hn: for pair i < d / 2 at angle a = float32(p) * inv_freq[i] (fp32),
        out[i] = x[i] cos a - x[i + d/2] sin a,   out[i + d/2] = x[i + d/2] cos a + x[i] sin a,
    channels d.. hn unchanged, fp32 math, results in the inputs' dtype.

    Returns (query', key') as [b, heads, s, hn] (``batch_first``, the layout of
    scaled_dot_product_attention) or [s, b, heads, hn]. The Triton path (triton_rotary: one launch
    for both, cos/sin in registers) returns contiguous tensors and its backward writes contiguous
    [s, b, heads, hn] gradients; the reference returns permuted views when ``batch_first``. Needs
    inv_freq fp32, integer positions and equal query/key dtypes, else the reference runs.
    """
    _check_rotary_arguments(query, key, position_ids, inv_freq)
    return fused_or_reference(
        "triton_rotary", (query, key, position_ids, inv_freq),
        lambda: rotary_constraint_violation(query, key, position_ids, inv_freq),
        lambda kernels: kernels.RotaryEmbeddingFunction.apply(query, key, position_ids, inv_freq, batch_first),
        lambda: rotary_embedding_reference(query, key, position_ids, inv_freq, batch_first))
