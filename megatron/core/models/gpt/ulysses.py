"""DeepSpeed-Ulysses attention with its all-to-alls hidden behind the attention of other key/value groups.

Notation: S ranks in the sequence-parallel group, rank r; s the whole sequence (each rank holds s / S
positions), b micro-batch, G the key/value groups of this TP rank, w = (q + 2) hn the width of one group in
the query_key_value projection's output (its q query heads, key and value), C chunks (``chunk_count``:
one unless every attention call keeps MIN_HEADS_PER_CALL query heads).

Chunk c holds groups [c G / C, (c + 1) G / C). Its share for rank j is the G / (C S) groups starting at
c G / C + j G / (C S): rank j attends over the whole sequence for those. Per chunk, forward:

    send[j]  = mixed[:, :, share(c, j)]               [S, s / S, b, G w / (C S)]   (a gather copy)
    recv     = all_to_all(send)                       [S, s / S, b, ..] = [s, b, G w / (C S)]: rank
                                                      j's positions of my share, in sequence order
    context  = attend_share(recv, c)                  [s, b, H hn], H = q G / (C S) query heads
    back     = all_to_all(context as [S, s / S, b, H hn])   back[j]: my positions of rank j's share
    output[:, :, chunk c, share of j] = back[j]       [s / S, b, n hn]: dense's input, heads in order

One all-to-all carries a chunk's queries, keys and values together, and the sequence leads every
exchanged layout, so the received blocks are the whole sequence without a copy. The pipeline launches
chunk c + 1's all-to-all before chunk c's attention, so the exchange runs on the communication stream
while the attention runs; chunk c's result goes back during chunk c + 1's attention. Backward is the
same pipeline on the gradients: dcontext of chunk c + 1 arrives during chunk c's attention backward,
and d(recv) of chunk c returns during chunk c + 1's. Each chunk's attention is its own autograd graph,
built in forward and differentiated in backward, so the exchanges can be ordered around it.

NCCL's all-to-all runs on the SMs, beside the work it is meant to hide behind; through peer memory
(EXCHANGE) each exchange instead runs on a side stream through symmetric memory (``start_peer_all_to_all``:
the copy engines carry the blocks over NVLink) and also copies the returned blocks into place there.

The projection's bias is already inside ``mixed`` (ColumnParallelLinear's ``bias_grad_by_caller``): its
gradient is the row sum of dmixed, a partial sum over this rank's positions like every weight
gradient under Ulysses.
"""
from typing import Callable

import torch
from torch.distributed import ProcessGroup

from megatron.core.parallel_state import group_size
from megatron.core.tensor_parallel.async_tp import peer_memory_reaches, start_peer_all_to_all
from megatron.core.tensor_parallel.utils import divide, start_all_to_all, start_all_to_all_of_others

MAX_CHUNKS = 4  # a few chunks hide most of the exchange
# Fewer query heads per attention call run slower: the 1.3B GPT at S = 2 and sequence 32768 (8 heads per
# rank) trained at 729.5 model TFLOP/s per GPU with one chunk, 725.4 with two (4 heads per call) and 718.8
# with four (2 heads), on H200s in one call: the overlap did not repay narrower calls there.
MIN_HEADS_PER_CALL = 8
# How the exchange travels between GPUs: "nccl" (NCCL's kernels, on the SMs), "peer" (copy engines through
# symmetric memory, start_peer_all_to_all: the SMs stay with the work beside it), or "auto": "peer" where the
# sequence-parallel group's GPUs share a host and can map each other's memory (peer_memory_reaches), else
# "nccl". Gloo groups (CPU tensors) take the plain collectives whatever it says.
EXCHANGE = "auto"
# Where the exchanges hide: False, behind the attention of other chunks of heads (pipelined_attention); True,
# behind the projections' GEMMs with one attention call for all of a rank's heads (ulysses_projections; at
# TP = 1 without FP8, else as False). The 1.3B GPT at S = 2 and sequence 32768 on two H200s in one call:
# 735.3 model TFLOP/s per GPU pipelined in one chunk, 750.2 beside the projections (755.2 through peer memory).
OVERLAP_PROJECTIONS = True

AttendShare = Callable[[torch.Tensor, int], torch.Tensor]  # (recv [s, b, G w / (C S)], chunk) -> [s, b, H hn]


def chunk_count(groups_per_rank: int, sequence_parallel_size: int, queries_per_group: int = 1) -> int:
    """C: the largest count up to MAX_CHUNKS that splits every rank's G / S groups evenly and leaves each
    attention call at least MIN_HEADS_PER_CALL query heads (1 when the rank has fewer)."""
    shares = divide(groups_per_rank, sequence_parallel_size)
    return max(c for c in range(1, MAX_CHUNKS + 1)
               if shares % c == 0 and (c == 1 or shares // c * queries_per_group >= MIN_HEADS_PER_CALL))


def pipelined_attention(mixed: torch.Tensor, bias: torch.Tensor | None, attend_share: AttendShare,
                        group: ProcessGroup, chunks: int) -> torch.Tensor:
    """mixed [s / S, b, G w] (bias [G w] already added, or None) -> dense's input [s / S, b, n hn]
    (module docstring). ``attend_share(recv, c)`` attends over the whole sequence for this rank's share
    of chunk c and returns its heads' outputs, merged; it runs under grad mode when gradients are on."""
    if not torch.is_grad_enabled():
        return _exchange_forward(mixed, attend_share, group, chunks, graphs=None)
    return _PipelinedUlysses.apply(mixed, bias, attend_share, group, chunks)


def _pipeline(chunks: int, group: ProcessGroup, send_of: Callable[[int], torch.Tensor],
              compute: Callable[[int, torch.Tensor], torch.Tensor],
              destination: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
    """For each chunk c: exchange send_of(c) [S, ...], compute(c, received) [S, ...], exchange that back
    into destination(c, computed) (a view [S, ...]). Chunk c + 1's first exchange is launched before
    compute(c), chunk c's second before compute(c + 1): the collectives run beside the computation."""
    incoming = start_exchange(send_of(0), group)
    outgoing = []
    for c in range(chunks):
        received, work = incoming
        if c + 1 < chunks:
            incoming = start_exchange(send_of(c + 1), group)
        work.wait()
        computed = compute(c, received)
        outgoing.append(start_exchange(computed, group, destination(c, computed)))
    for _, work in outgoing:
        work.wait()


class _CopyAfterWait:
    """A started all-to-all whose wait also copies the received blocks into their destination."""

    def __init__(self, work, received: torch.Tensor, into: torch.Tensor):
        self.work, self.received, self.into = work, received, into

    def wait(self) -> None:
        self.work.wait()
        self.into.copy_(self.received)


def start_exchange(blocks: torch.Tensor, group: ProcessGroup, into: torch.Tensor | None = None,
                   with_own: bool = True) -> tuple[torch.Tensor, object]:
    """The all-to-all of ``blocks`` [S, ...] started (EXCHANGE: through peer memory on CUDA, where the
    copy into ``into`` runs on the exchange's stream too); with ``into`` the blocks land there. Without
    ``with_own`` only the other ranks' blocks travel: received[r] is left to the caller, who may write
    it (and blocks[r] need not be written) while the others travel."""
    if _through_peer_memory(blocks, group):
        return start_peer_all_to_all(blocks, group, into, with_own)
    if not with_own:
        if into is not None:
            raise ValueError("an exchange without the own block lands in a new tensor, not into a view")
        return start_all_to_all_of_others(blocks, group)
    received, work = start_all_to_all(blocks, group)
    return (received, work) if into is None else (into, _CopyAfterWait(work, received, into))


def _through_peer_memory(blocks: torch.Tensor, group: ProcessGroup) -> bool:
    """Whether this exchange goes through symmetric memory (EXCHANGE)."""
    if not blocks.is_cuda or EXCHANGE == "nccl":
        return False
    return EXCHANGE == "peer" or peer_memory_reaches(group)


def _chunked(tensor: torch.Tensor, chunks: int, size: int) -> torch.Tensor:
    """[s', b, C * S * m] -> a view [s', b, C, S, m]."""
    return tensor.unflatten(-1, (chunks, size, -1))


def _exchange_forward(mixed: torch.Tensor, attend_share: AttendShare, group: ProcessGroup, chunks: int,
                      graphs: list | None) -> torch.Tensor:
    """The forward pipeline; ``graphs`` (a list) collects each chunk's (recv leaf, context) for backward."""
    size = group_size(group)
    local, batch = mixed.shape[:2]
    shares = _chunked(mixed, chunks, size)
    output = None

    def send_of(c):
        return shares[:, :, c].movedim(2, 0)  # [S, s / S, b, G w / (C S)]

    def compute(c, received):
        recv = received.view(size * local, batch, -1)  # [s, b, G w / (C S)]
        if graphs is None:
            context = attend_share(recv, c)
        else:
            with torch.enable_grad():
                recv = recv.detach().requires_grad_()
                context = attend_share(recv, c)
            graphs.append((recv, context))
        return context.detach().reshape(size, local, batch, -1)

    def destination(c, computed):
        nonlocal output
        if output is None:
            output = mixed.new_empty(local, batch, chunks * size * computed.shape[-1])
        return _chunked(output, chunks, size)[:, :, c].movedim(2, 0)  # [S, s / S, b, H hn]

    _pipeline(chunks, group, send_of, compute, destination)
    return output


class _PipelinedUlysses(torch.autograd.Function):
    """dense input = pipelined_attention(mixed); backward runs the pipeline on the gradients."""

    @staticmethod
    def forward(ctx, mixed, bias, attend_share, group, chunks):
        ctx.graphs = []
        ctx.group, ctx.chunks, ctx.mixed_shape, ctx.has_bias = group, chunks, mixed.shape, bias is not None
        return _exchange_forward(mixed, attend_share, group, chunks, ctx.graphs)

    @staticmethod
    def backward(ctx, grad_output):
        size, chunks, graphs = group_size(ctx.group), ctx.chunks, ctx.graphs
        local, batch = grad_output.shape[:2]
        grad_shares = _chunked(grad_output, chunks, size)
        grad_mixed = grad_output.new_empty(ctx.mixed_shape)

        def send_of(c):
            return grad_shares[:, :, c].movedim(2, 0)  # my positions of every rank's share of chunk c

        def compute(c, received):
            recv, context = graphs[c]
            grad_recv, = torch.autograd.grad(context, recv, received.view(context.shape))
            graphs[c] = None  # the chunk's graph is spent
            return grad_recv.view(size, local, batch, -1)

        def destination(c, computed):
            return _chunked(grad_mixed, chunks, size)[:, :, c].movedim(2, 0)

        _pipeline(chunks, ctx.group, send_of, compute, destination)
        ctx.graphs = None
        grad_bias = grad_mixed.sum(dim=(0, 1)) if ctx.has_bias and ctx.needs_input_grad[1] else None
        return grad_mixed, grad_bias, None, None, None
