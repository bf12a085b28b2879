"""DeepSpeed-Ulysses with its all-to-alls hidden behind the projections' GEMMs, attention in one call.

``ulysses.pipelined_attention`` hides the exchanges behind the attention of other chunks of heads, which
narrows each attention call; here the attention of all this rank's heads is one call, and the exchanges
run beside the two projections instead (at TP = 1, without FP8).

Notation as ``ulysses``: S ranks, this rank r, s the whole sequence, m = s / S positions per rank, b
micro-batch, M = m b rows, h hidden, G key/value groups of q query heads of hn channels, H = q G heads.
The query_key_value weight W [G (q + 2) hn, h] holds per group its q query heads, key and value; part p
(query, key, value) is w_p = q, 1, 1 heads of each group, and W_{p,j} [X_p, h] the rows of part p of the
G / S groups rank j attends for (X_p = (G / S) w_p hn). D [h, H hn] is dense's weight, D_j its columns of
rank j's heads (Y = (H / S) hn of them).

Forward, each exchange (``ulysses.start_exchange``) started as soon as its blocks exist:

    for p in query, key, value:
        out_p[j] = x W_{p,j}^T + b_{p,j}         [S, M, X_p]   part p of rank j's groups at my positions
        exchange(out_p) -> recv_p                 [S, M, X_p] = [s, b, X_p]: my groups, whole sequence;
                                                  it runs beside the next part's GEMMs
    context = attend(recv_q, recv_k, recv_v)      [s, b, Y]     all my heads in one attention call
    exchange(context as [S, M, Y]) -> back        back[j]: rank j's heads at my positions
    y = context[my positions] D_r^T               beside that exchange: my heads at my positions
        + sum over j != r of back[j] D_j^T        [M, h]

Backward mirrors it: dback[j] = dy D_j goes back first, dD_j = dy^T back[j] runs beside it; the
attention's graph (built in forward) gives drecv_p, each part sent back as soon as it exists, and part
p's dx += sum_j dout_p[j] W_{p,j} and dW_{p,j} = dout_p[j]^T x run beside the later parts' exchanges.
A weight with a ``main_grad`` (the trainer's fp32 accumulator) gets its gradient added there, as the
parallel linear layers do.
"""
from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed import ProcessGroup

from megatron.core.models.gpt import ulysses
from megatron.core.parallel_state import group_rank, group_size

# Attends over the whole sequence: (query [s, b, H / S, hn], key, value [s, b, G / S, hn]) -> [s, b, Y].
AttendAll = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class HeadLayout:
    """The query_key_value rows: ``groups`` G key/value groups of ``queries_per_group`` q query heads,
    ``head_dim`` hn channels each."""
    groups: int
    queries_per_group: int
    head_dim: int

    def part_rows(self) -> list[tuple[int, int]]:
        """Within one group's (q + 2) hn rows: the query, key and value rows [start, end)."""
        q, hn = self.queries_per_group, self.head_dim
        return [(0, q * hn), (q * hn, (q + 1) * hn), ((q + 1) * hn, (q + 2) * hn)]


def overlapped_attention(x: torch.Tensor, qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None,
                         dense_weight: torch.Tensor, attend: AttendAll, layout: HeadLayout,
                         group: ProcessGroup) -> torch.Tensor:
    """x [m, b, h] (this rank's positions) -> dense's output without its bias [m, b, h] (module docstring)."""
    if not torch.is_grad_enabled():
        return _forward(x, qkv_weight, qkv_bias, dense_weight, attend, layout, group, graph=None)[0]
    return _OverlappedUlysses.apply(x, qkv_weight, qkv_bias, dense_weight, attend, layout, group)


def _part_weights(tensor: torch.Tensor, layout: HeadLayout, part: int, size: int) -> torch.Tensor:
    """Part ``part``'s rows of the query_key_value weight [G (q + 2) hn, h] (or bias, trailing dim absent)
    by the rank that attends for them: [S, X_p, h] (or [S, X_p]), a copy."""
    start, end = layout.part_rows()[part]
    grouped = tensor.view(layout.groups, -1, *tensor.shape[1:])[:, start:end]  # [G, w_p hn, ..]
    return grouped.reshape(size, -1, *tensor.shape[1:])


def _scatter_part(grad: torch.Tensor, blocks: torch.Tensor, layout: HeadLayout, part: int) -> None:
    """The inverse of ``_part_weights``: ``blocks`` [S, X_p, ..] into part ``part``'s rows of ``grad``."""
    start, end = layout.part_rows()[part]
    grad.view(layout.groups, -1, *grad.shape[1:])[:, start:end] = blocks.reshape(layout.groups, end - start,
                                                                               *grad.shape[1:])


def _product(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a b in ``dtype`` (on CUDA cuBLAS writes fp32 from bf16 operands directly, never rounding to bf16)."""
    if dtype == a.dtype:
        return a.matmul(b)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=dtype)
    return a.matmul(b).to(dtype)


def _gradient_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype a weight's gradient is built in: its main_grad accumulator's, if it has one."""
    main_grad = getattr(weight, "main_grad", None)
    return weight.dtype if main_grad is None else main_grad.dtype


def _delivered(weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
    """The weight gradient autograd gets: ``grad``, or None once it is added into ``weight.main_grad``."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        return grad
    main_grad.add_(grad)
    return None


def _forward(x, qkv_weight, qkv_bias, dense_weight, attend, layout, group,
             graph: list | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense's output [m, b, h], back [S, M, Y]); with ``graph`` (a list) the attention runs under grad
    mode on leaves of the received parts, and (leaves, context) is appended for backward."""
    size, rank = group_size(group), group_rank(group)
    local, batch, hidden = x.shape
    rows = x.reshape(-1, hidden)  # [M, h]
    incoming = [ulysses.start_exchange(_part_outputs(rows, qkv_weight, qkv_bias, layout, part, size), group)
                for part in range(3)]  # each part's exchange beside the next part's GEMMs
    received = []
    for blocks, work in incoming:
        work.wait()
        received.append(blocks.view(size * local, batch, -1))  # [s, b, X_p]
    if graph is None:
        context = attend(*(part.unflatten(-1, (-1, layout.head_dim)) for part in received))
    else:
        with torch.enable_grad():
            leaves = [part.detach().requires_grad_() for part in received]
            context = attend(*(leaf.unflatten(-1, (-1, layout.head_dim)) for leaf in leaves))  # [s, b, Y]
        graph.append((leaves, context))
    heads = context.detach().view(size, local * batch, -1)  # [S, M, Y], by the rank of the positions
    back, work = ulysses.start_exchange(heads, group)
    dense_blocks = dense_weight.split(heads.shape[-1], dim=1)  # D_j [h, Y]
    output = heads[rank].matmul(dense_blocks[rank].t())  # [M, h], beside the exchange
    work.wait()
    for j in range(size):
        if j != rank:
            output.addmm_(back[j], dense_blocks[j].t())
    return output.view(local, batch, hidden), back


class _OverlappedUlysses(torch.autograd.Function):
    """dense(attention(query_key_value(x))) under Ulysses without dense's bias (module docstring)."""

    @staticmethod
    def forward(ctx, x, qkv_weight, qkv_bias, dense_weight, attend, layout, group):
        graph = []
        output, back = _forward(x, qkv_weight, qkv_bias, dense_weight, attend, layout, group, graph)
        ctx.save_for_backward(x, qkv_weight, dense_weight, back)
        ctx.graph, ctx.layout, ctx.group, ctx.has_bias = graph[0], layout, group, qkv_bias is not None
        return output

    @staticmethod
    def backward(ctx, grad_output):
        x, qkv_weight, dense_weight, back = ctx.saved_tensors
        (leaves, context), ctx.graph = ctx.graph, None
        size, group, layout = group_size(ctx.group), ctx.group, ctx.layout
        local, batch, hidden = x.shape
        grad_rows = grad_output.reshape(-1, hidden)  # [M, h]
        grad_heads = grad_rows.new_empty(size, grad_rows.shape[0], back.shape[-1])
        for j, block in enumerate(dense_weight.split(back.shape[-1], dim=1)):  # dback[j] = dy D_j
            torch.mm(grad_rows, block, out=grad_heads[j])
        grad_heads, work = ulysses.start_exchange(grad_heads, group)  # [S, M, Y] = d context [s, b, Y]
        grad_dense = _dense_weight_grad(grad_rows, back, dense_weight)  # beside the exchange
        work.wait()
        grad_parts = torch.autograd.grad(context, leaves, grad_heads.view(context.shape))  # [s, b, X_p] each
        outgoing = [ulysses.start_exchange(part.reshape(size, local * batch, -1), group) for part in grad_parts]
        grad_x, grad_qkv, grad_bias = _projection_grads(x.reshape(-1, hidden), qkv_weight, outgoing, layout, size,
                                                        ctx.has_bias)
        return grad_x.view(x.shape), grad_qkv, grad_bias, grad_dense, None, None, None


def _part_outputs(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layout: HeadLayout,
                  part: int, size: int) -> torch.Tensor:
    """out_p [S, M, X_p]: part ``part`` of every rank's groups at this rank's rows [M, h], one GEMM per rank."""
    weights = _part_weights(weight, layout, part, size)  # [S, X_p, h]
    biases = None if bias is None else _part_weights(bias, layout, part, size)  # [S, X_p]
    out = rows.new_empty(size, rows.shape[0], weights.shape[1])
    for j in range(size):
        if biases is None:
            torch.mm(rows, weights[j].t(), out=out[j])
        else:
            torch.addmm(biases[j], rows, weights[j].t(), out=out[j])
    return out


def _dense_weight_grad(grad_rows: torch.Tensor, back: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """dD [h, H hn], D_j's columns dy^T back[j] (added into main_grad when the weight has one)."""
    dtype = _gradient_dtype(weight)
    transposed = torch.stack([_product(block.t(), grad_rows, dtype) for block in back])  # [S, Y, h] = dD_j^T
    return _delivered(weight, transposed.view(-1, grad_rows.shape[1]).t().contiguous())


def _projection_grads(rows: torch.Tensor, weight: torch.Tensor, outgoing: list, layout: HeadLayout, size: int,
                      has_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx [M, h], dW, db) from each part's returned gradient dout_p [S, M, X_p], taken as it arrives."""
    dtype = _gradient_dtype(weight)
    grad_x = None
    grad_weight = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    grad_bias = torch.empty(weight.shape[0], dtype=rows.dtype, device=rows.device) if has_bias else None
    for part, (grad_out, work) in enumerate(outgoing):
        work.wait()
        weights = _part_weights(weight, layout, part, size)  # [S, X_p, h]
        for j in range(size):
            if grad_x is None:
                grad_x = grad_out[j].matmul(weights[j])
            else:
                grad_x.addmm_(grad_out[j], weights[j])
        _scatter_part(grad_weight, torch.stack([_product(block.t(), rows, dtype) for block in grad_out]), layout,
                      part)
        if grad_bias is not None:
            _scatter_part(grad_bias, grad_out.sum(dim=1), layout, part)
    return grad_x, _delivered(weight, grad_weight), grad_bias
