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

Forward, each exchange (``ulysses.start_exchange``, the other ranks' blocks only) started as soon as its
blocks exist, the blocks that stay on this rank computed while they travel:

    for p in query, key, value:
        out_p[j] = x W_{p,j}^T + b_{p,j}, j != r  [S, M, X_p]   part p of rank j's groups at my positions
        exchange(out_p) -> recv_p                 [S, M, X_p] = [s, b, X_p]: my groups, whole sequence;
                                                  it runs beside the next part's GEMMs
    recv_p[r] = x W_{p,r}^T + b_{p,r}             my groups at my positions, beside the three exchanges
    context = attend(recv_q, recv_k, recv_v)      [s, b, Y]     all my heads in one attention call
    exchange(context as [S, M, Y]) -> back        back[j]: rank j's heads at my positions
    y = context[my positions] D_r^T               beside that exchange: my heads at my positions
        + sum over j != r of back[j] D_j^T        [M, h]

Backward mirrors it: dback[j] = dy D_j for j != r goes back first, my own dback[r] and dD_j = dy^T
back[j] run beside it; the attention's graph (built in forward) gives drecv_p, each part's blocks for
the other ranks sent back at once, and dx = sum_{p,j} dout_p[j] W_{p,j}, dW_{p,j} = dout_p[j]^T x are
computed for my own positions (j = r) beside those exchanges, then for each part's as it arrives.
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


def _part_rows(tensor: torch.Tensor, layout: HeadLayout, part: int, size: int) -> torch.Tensor:
    """A view of part ``part``'s rows of the query_key_value weight [G (q + 2) hn, h] (or bias, trailing
    dim absent) by the rank that attends for them: [S, G / S, w_p hn, h] (or [S, G / S, w_p hn])."""
    start, end = layout.part_rows()[part]
    return tensor.view(layout.groups, -1, *tensor.shape[1:])[:, start:end].unflatten(0, (size, -1))


def _part_weights(tensor: torch.Tensor, layout: HeadLayout, part: int, size: int) -> torch.Tensor:
    """``_part_rows`` as blocks W_{p,j}: [S, X_p, h] (or [S, X_p]), a copy."""
    return _part_rows(tensor, layout, part, size).reshape(size, -1, *tensor.shape[1:])


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
             graph: list | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dense's output [m, b, h], back [S, M, Y] (back[r] not written), heads [S, M, Y]); with ``graph``
    (a list) the attention runs under grad mode on leaves of the received parts, and (leaves, context)
    is appended for backward."""
    size, rank = group_size(group), group_rank(group)
    local, batch, hidden = x.shape
    rows = x.reshape(-1, hidden)  # [M, h]
    weights = [_part_weights(qkv_weight, layout, part, size) for part in range(3)]  # [S, X_p, h] each
    biases = [None if qkv_bias is None else _part_weights(qkv_bias, layout, part, size) for part in range(3)]
    others = [j for j in range(size) if j != rank]
    incoming = []
    for part in range(3):  # each part's exchange beside the next part's GEMMs
        blocks = rows.new_empty(size, rows.shape[0], weights[part].shape[1])  # [S, M, X_p], own block unused
        _project(rows, weights[part], biases[part], others, blocks)
        incoming.append(ulysses.start_exchange(blocks, group, with_own=False))
    for part, (received, _) in enumerate(incoming):  # my groups at my positions, beside the exchanges
        _project(rows, weights[part], biases[part], [rank], received)
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
    back, work = ulysses.start_exchange(heads, group, with_own=False)
    dense_blocks = dense_weight.split(heads.shape[-1], dim=1)  # D_j [h, Y]
    output = heads[rank].matmul(dense_blocks[rank].t())  # [M, h], beside the exchange
    work.wait()
    for j in others:
        output.addmm_(back[j], dense_blocks[j].t())
    return output.view(local, batch, hidden), back, heads


class _OverlappedUlysses(torch.autograd.Function):
    """dense(attention(query_key_value(x))) under Ulysses without dense's bias (module docstring)."""

    @staticmethod
    def forward(ctx, x, qkv_weight, qkv_bias, dense_weight, attend, layout, group):
        graph = []
        output, back, heads = _forward(x, qkv_weight, qkv_bias, dense_weight, attend, layout, group, graph)
        ctx.save_for_backward(x, qkv_weight, dense_weight, back, heads)
        ctx.graph, ctx.layout, ctx.group, ctx.has_bias = graph[0], layout, group, qkv_bias is not None
        return output

    @staticmethod
    def backward(ctx, grad_output):
        x, qkv_weight, dense_weight, back, heads = ctx.saved_tensors
        (leaves, context), ctx.graph = ctx.graph, None
        size, rank, group = group_size(ctx.group), group_rank(ctx.group), ctx.group
        local, batch, hidden = x.shape
        grad_rows = grad_output.reshape(-1, hidden)  # [M, h]
        dense_blocks = dense_weight.split(back.shape[-1], dim=1)  # D_j [h, Y]
        grad_heads = grad_rows.new_empty(size, grad_rows.shape[0], back.shape[-1])
        for j in range(size):  # dback[j] = dy D_j
            if j != rank:
                torch.mm(grad_rows, dense_blocks[j], out=grad_heads[j])
        grad_context, work = ulysses.start_exchange(grad_heads, group, with_own=False)  # [S, M, Y] = [s, b, Y]
        torch.mm(grad_rows, dense_blocks[rank], out=grad_context[rank])  # beside the exchange, as dD
        grad_dense = _dense_weight_grad(grad_rows, [heads[j] if j == rank else back[j] for j in range(size)],
                                        dense_weight)
        work.wait()
        grad_parts = torch.autograd.grad(context, leaves, grad_context.view(context.shape))  # [s, b, X_p] each
        part_blocks = [part.reshape(size, local * batch, -1) for part in grad_parts]  # [S, M, X_p]
        outgoing = [ulysses.start_exchange(blocks, group, with_own=False) for blocks in part_blocks]
        grad_x, grad_qkv, grad_bias = _projection_grads(x.reshape(-1, hidden), qkv_weight, part_blocks, outgoing,
                                                        ctx.layout, rank, ctx.has_bias)
        return grad_x.view(x.shape), grad_qkv, grad_bias, grad_dense, None, None, None


def _project(rows: torch.Tensor, weights: torch.Tensor, biases: torch.Tensor | None, ranks: list[int],
             out: torch.Tensor) -> None:
    """out[j] = rows W_{p,j}^T + b_{p,j} [M, X_p] for each j of ``ranks``: part p of rank j's groups at this
    rank's rows, from W_{p,j} = weights[j] [X_p, h], b_{p,j} = biases[j] [X_p] (or none)."""
    for j in ranks:
        if biases is None:
            torch.mm(rows, weights[j].t(), out=out[j])
        else:
            torch.addmm(biases[j], rows, weights[j].t(), out=out[j])


def _dense_weight_grad(grad_rows: torch.Tensor, blocks: list[torch.Tensor],
                       weight: torch.Tensor) -> torch.Tensor | None:
    """dD [h, H hn], D_j's columns dy^T blocks[j] [M, Y] (added into main_grad when the weight has one)."""
    dtype = _gradient_dtype(weight)
    transposed = torch.stack([_product(block.t(), grad_rows, dtype) for block in blocks])  # [S, Y, h] = dD_j^T
    return _delivered(weight, transposed.view(-1, grad_rows.shape[1]).t().contiguous())


def _projection_grads(rows: torch.Tensor, weight: torch.Tensor, part_blocks: list[torch.Tensor], outgoing: list,
                      layout: HeadLayout, rank: int,
                      has_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx [M, h], dW, db) from each part's gradient dout_p [S, M, X_p]: block r of ``part_blocks`` (this
    rank's positions, never sent) first, beside the exchanges; each part's returned blocks as they arrive."""
    size = len(part_blocks[0])
    dtype = _gradient_dtype(weight)
    weights = [_part_weights(weight, layout, part, size) for part in range(3)]  # [S, X_p, h] each
    grad_weight = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    grad_bias = torch.empty(weight.shape[0], dtype=rows.dtype, device=rows.device) if has_bias else None
    grad_x = None

    def add(part: int, j: int, block: torch.Tensor) -> None:  # block dout_p[j] [M, X_p]
        nonlocal grad_x
        grad_x = block.matmul(weights[part][j]) if grad_x is None else grad_x.addmm_(block, weights[part][j])
        groups = _part_rows(grad_weight, layout, part, size)[j]  # [G / S, w_p hn, h]
        groups.copy_(_product(block.t(), rows, dtype).view(groups.shape))
        if grad_bias is not None:
            bias_groups = _part_rows(grad_bias, layout, part, size)[j]
            bias_groups.copy_(block.sum(dim=0).view(bias_groups.shape))

    for part in range(3):
        add(part, rank, part_blocks[part][rank])
    for part, (received, work) in enumerate(outgoing):
        work.wait()
        for j in range(size):
            if j != rank:
                add(part, j, received[j])
    return grad_x, _delivered(weight, grad_weight), grad_bias
