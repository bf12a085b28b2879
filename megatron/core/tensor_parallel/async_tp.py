"""Async tensor parallelism (--tp-comm-overlap): the TP group's collectives fused with the GEMMs that
consume or produce them, through symmetric GPU memory.

``all_gather_matmul`` (and its block-by-block form ``all_gather_matmul_each_block``) computes X B
with X gathered along the first dimension, and ``matmul_reduce_scatter`` (started and awaited apart
by ``start_matmul_reduce_scatter``) reduce-scatters A B: on CUDA the peer copies run on a side stream
beside the GEMMs, elsewhere (gloo) the plain collective and the product one after the other. The
parallel layers call them under ``comm_overlap``; the autograd collectives of the model's regions
live in ``mappings``.
"""
import functools
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megatron.core.parallel_state import group_rank, group_size
from megatron.core.tensor_parallel.utils import (all_gather_along_first_dim, divide, reduce_scatter_along_first_dim,
                                                 start_reduce_scatter_along_first_dim)


class _PeerBuffers:
    """Two slots of symmetric memory per TP group (each rank's slots writable by its peers over
    NVLink), used in turn by the fused collectives below, and a side stream for the peer copies
    (of high priority: its barrier kernel takes the first SM a GEMM beside it frees).

    Each call writes its peers' slots at its place, passes one group barrier, then reads its own
    slot of the same call and joins those reads into the current stream before the call (or, for
    start_matmul_reduce_scatter, its wait) returns. A rank writes a slot again two calls later,
    after the barrier of the call between, which every peer reaches only once its reads of the
    slot are done: one barrier per call keeps the slots safe. The barriers of successive calls run
    one after the other on each rank (each call's side stream first waits for the current stream,
    which waits for the side stream before returning).
    """

    def __init__(self, group: ProcessGroup):
        import torch.distributed._symmetric_memory as symmetric_memory  # here: CUDA runs only, not every start-up

        self.symmetric_memory = symmetric_memory
        with warnings.catch_warnings():  # required by some torch versions, deprecated by later ones
            warnings.simplefilter("ignore", FutureWarning)
            symmetric_memory.enable_symm_mem_for_group(group.group_name)
        self.group, self.rank, self.size = group, group_rank(group), group_size(group)
        self.stream = torch.cuda.Stream(priority=-1)
        self.slot_bytes, self.calls = 0, 0
        self.memory = self.handle = None
        self.views: dict = {}

    def _grow(self, slot_bytes: int, device: torch.device) -> None:
        """Reallocate both slots (a collective): every rank first finishes its work, peer reads of
        the old slots included, so that they can be freed."""
        torch.cuda.synchronize()
        dist.barrier(group=self.group)
        try:
            self.memory = self.symmetric_memory.empty(2 * slot_bytes, dtype=torch.uint8, device=device)
            self.handle = self.symmetric_memory.rendezvous(self.memory, self.group.group_name)
        except RuntimeError as error:
            raise RuntimeError("the TP group's GPUs cannot map each other's memory (symmetric memory: "
                               f"{error}); --tp-comm-overlap needs the TP group on one node with peer access "
                               "(NVLink or PCIe P2P): drop the flag") from error
        self.slot_bytes, self.views = slot_bytes, {}

    def next_slot(self, nbytes: int, device: torch.device) -> int:
        """Byte offset of this call's slot, holding at least ``nbytes``."""
        if nbytes > self.slot_bytes:
            self._grow(nbytes, device)
        self.calls += 1
        return (self.calls % 2) * self.slot_bytes

    def view(self, rank: int, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Rank ``rank``'s slot memory at byte ``offset`` as a contiguous tensor of ``shape``."""
        key = (rank, offset, tuple(shape), dtype)
        if key not in self.views:
            self.views[key] = self.handle.get_buffer(rank, tuple(shape), dtype, offset // dtype.itemsize)
        return self.views[key]

    def barrier(self) -> None:
        self.handle.barrier(channel=0)


@functools.cache
def _peer_buffers(group: ProcessGroup) -> _PeerBuffers:
    return _PeerBuffers(group)


def _uses_peer_memory(tensor: torch.Tensor, group: ProcessGroup) -> bool:
    return tensor.is_cuda and group_size(group) > 1


def _push_shard(x: torch.Tensor, peers: _PeerBuffers) -> tuple[dict[int, torch.Tensor], torch.cuda.Event]:
    """Push this rank's block ``x`` [n, m] into each peer's slot (side stream) and pass the barrier:
    ({peer rank: its block, as received in this rank's slot}, the event past which they have landed)."""
    current = torch.cuda.current_stream()
    block_bytes = x.numel() * x.element_size()
    offset = peers.next_slot(peers.size * block_bytes, x.device)  # a block per sending rank
    others = [rank for rank in range(peers.size) if rank != peers.rank]
    received = {rank: peers.view(peers.rank, offset + rank * block_bytes, x.shape, x.dtype) for rank in others}
    peers.stream.wait_stream(current)
    with torch.cuda.stream(peers.stream):
        for rank in others:  # into the peer's slot, at this rank's place
            peers.view(rank, offset + peers.rank * block_bytes, x.shape, x.dtype).copy_(x)
        peers.barrier()  # past it, every peer's block has landed in this rank's slot
        arrived = torch.cuda.Event()
        arrived.record()
    return received, arrived


def all_gather_matmul(shard: torch.Tensor, matrix: torch.Tensor, group: ProcessGroup,
                      bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(X, X B + c) with X the all-gather of the k ranks' ``shard`` [n, .., m] along dim 0 ([k n, .., m]),
    B = ``matrix`` [m, p] and c = ``bias`` [p] (or none).

    On CUDA the gather is pipelined with the product: while rank r multiplies its own block, the side
    stream pushes that block into each peer's symmetric memory (copy engines over NVLink, no SMs
    taken from the GEMM) and passes the group's barrier, after which the peers' blocks lie in rank
    r's own slot and are multiplied from there. Nothing runs on the GEMMs' stream but GEMMs: the
    copies into the returned X (kept by the callers for dW) run on the side stream beside them.
    Elsewhere (gloo) the all-gather, then the product.
    """
    if not _uses_peer_memory(shard, group):
        gathered = all_gather_along_first_dim(shard, group)
        return gathered, torch.nn.functional.linear(gathered, matrix.t(), bias)
    peers, current = _peer_buffers(group), torch.cuda.current_stream()
    x = shard.reshape(-1, shard.shape[-1])  # [n, m]
    rows = x.shape[0]
    gathered = x.new_empty(peers.size * rows, x.shape[1])  # [k n, m]
    product = x.new_empty(peers.size * rows, matrix.shape[1])  # [k n, p]
    received, arrived = _push_shard(x, peers)
    with torch.cuda.stream(peers.stream):
        for rank, block in received.items():
            gathered[rank * rows:(rank + 1) * rows].copy_(block)
        gathered[peers.rank * rows:(peers.rank + 1) * rows].copy_(x)
    multiply = torch.mm if bias is None else functools.partial(torch.addmm, bias)
    multiply(x, matrix, out=product[peers.rank * rows:(peers.rank + 1) * rows])
    current.wait_event(arrived)
    for rank, block in received.items():
        multiply(block, matrix, out=product[rank * rows:(rank + 1) * rows])
    current.wait_stream(peers.stream)
    leading = (peers.size * shard.shape[0], *shard.shape[1:-1])
    return gathered.view(*leading, x.shape[1]), product.view(*leading, matrix.shape[1])


def all_gather_matmul_each_block(shard: torch.Tensor, matrix: torch.Tensor, group: ProcessGroup,
                                 use_block: Callable[[int, torch.Tensor], None]) -> torch.Tensor:
    """X B as all_gather_matmul, without returning X: instead ``use_block(r, X_r)`` is called on each
    rank's block X_r [n, m] of X (r = 0 .. k - 1, in no fixed order) once it is here, to issue the
    work that reads it (the weight gradient's share of that block: dW = sum over r of dY_r^T X_r).

    On CUDA the own block's product and ``use_block``'s work on it both run beside the push of the
    block to the peers, more work to hide it behind than all_gather_matmul's one GEMM; the peers'
    blocks are read from this rank's slot, never copied out. Elsewhere the all-gather, the product,
    then the blocks.
    """
    if not _uses_peer_memory(shard, group):
        gathered = all_gather_along_first_dim(shard, group)
        rows = gathered.reshape(-1, shard.shape[-1]).split(shard[..., 0].numel())  # k blocks [n, m]
        for rank, block in enumerate(rows):
            use_block(rank, block)
        return gathered.matmul(matrix)
    peers, current = _peer_buffers(group), torch.cuda.current_stream()
    x = shard.reshape(-1, shard.shape[-1])  # [n, m]
    rows = x.shape[0]
    product = x.new_empty(peers.size * rows, matrix.shape[1])  # [k n, p]
    received, arrived = _push_shard(x, peers)
    torch.mm(x, matrix, out=product[peers.rank * rows:(peers.rank + 1) * rows])
    use_block(peers.rank, x)
    current.wait_event(arrived)
    for rank, block in received.items():
        torch.mm(block, matrix, out=product[rank * rows:(rank + 1) * rows])
        use_block(rank, block)
    current.wait_stream(peers.stream)
    return product.view(peers.size * shard.shape[0], *shard.shape[1:-1], matrix.shape[1])


def _push_partial_products(x: torch.Tensor, matrix: torch.Tensor,
                           peers: _PeerBuffers) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Compute the blocks of X B [n, p] (X = ``x`` [n, m]) that the peers own, each pushed into its
    peer's slot (side stream) as soon as it is ready, then the barrier there: (this rank's own rows
    of X [n / k, m], the peers' blocks for this rank as they land in its slot, the outgoing blocks,
    which the side stream reads until the current stream waits for it)."""
    current = torch.cuda.current_stream()
    rows = divide(x.shape[0], peers.size)
    block_shape = torch.Size((rows, matrix.shape[1]))
    block_bytes = rows * matrix.shape[1] * x.element_size()
    offset = peers.next_slot(peers.size * block_bytes, x.device)  # a block per sending rank
    others = [rank for rank in range(peers.size) if rank != peers.rank]
    outgoing = x.new_empty(len(others), *block_shape)  # [k - 1, n / k, p]: the peers' blocks
    for index, rank in enumerate(others):
        torch.mm(x[rank * rows:(rank + 1) * rows], matrix, out=outgoing[index])
        peers.stream.wait_stream(current)
        with torch.cuda.stream(peers.stream):  # into the peer's slot, at this rank's place
            peers.view(rank, offset + peers.rank * block_bytes, block_shape, x.dtype).copy_(outgoing[index])
    with torch.cuda.stream(peers.stream):
        peers.barrier()  # past it, every peer's block for this rank has landed in its slot
    received = [peers.view(peers.rank, offset + rank * block_bytes, block_shape, x.dtype) for rank in others]
    return x[peers.rank * rows:(peers.rank + 1) * rows], received, outgoing


class _OwnBlockAfterTransfers:
    """The end of a started reduce-scatter: ``wait()`` makes the current stream wait for the side
    stream (barrier, then the received partial sums copied into the output), then adds the rest
    of them and the own block's product, the latter by the GEMM itself (beta = 1: no separate add).
    It holds the outgoing blocks until then: the side stream may still be reading them, and freed
    memory goes back to the current stream's pool."""

    def __init__(self, output: torch.Tensor, own_rows: torch.Tensor, matrix: torch.Tensor,
                 more_received: list[torch.Tensor], outgoing: torch.Tensor, peers: _PeerBuffers):
        self.output, self.own_rows, self.matrix = output, own_rows, matrix
        self.more_received, self.outgoing, self.peers = more_received, outgoing, peers

    def wait(self) -> None:
        torch.cuda.current_stream().wait_stream(self.peers.stream)
        self.outgoing = None
        for partial in self.more_received:
            self.output += partial
        self.output.addmm_(self.own_rows, self.matrix)


def start_matmul_reduce_scatter(a: torch.Tensor, matrix: torch.Tensor,
                                group: ProcessGroup) -> tuple[torch.Tensor, object]:
    """matmul_reduce_scatter launched asynchronously: (output, work), the output valid after
    ``work.wait()``; work issued in between (the weight gradient) runs beside the transfers. No
    other fused collective of the group may come in between: the wait reads this call's slot, and
    the slots' reuse rule (``_PeerBuffers``) counts on those reads preceding the next call's barrier.

    On CUDA each rank computes the blocks of its partial product that its peers own (local GEMMs);
    the side stream pushes each into that peer's symmetric memory as soon as it is ready (copy
    engines over NVLink), passes the group's barrier and copies the received partial sums into the
    output, all beside the caller's work. ``wait()`` then computes the own block into that sum
    (cuBLAS's beta = 1: the add happens in the GEMM's epilogue), so the reduction needs no
    elementwise pass of its own. Elsewhere the product, then the asynchronous reduce-scatter.
    """
    if not _uses_peer_memory(a, group):
        return start_reduce_scatter_along_first_dim(a.matmul(matrix), group)
    peers = _peer_buffers(group)
    own_rows, received, outgoing = _push_partial_products(a.reshape(-1, a.shape[-1]), matrix, peers)
    output = own_rows.new_empty(own_rows.shape[0], matrix.shape[1])  # [n / k, p]
    with torch.cuda.stream(peers.stream):
        output.copy_(received[0])
    work = _OwnBlockAfterTransfers(output, own_rows, matrix, received[1:], outgoing, peers)
    return output.view(a.shape[0] // peers.size, *a.shape[1:-1], matrix.shape[1]), work


def matmul_reduce_scatter(a: torch.Tensor, matrix: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Rank r's block [n / k, .., p] of sum over ranks of A B, A = ``a`` [n, .., m], B = ``matrix`` [m, p].

    On CUDA the peers' blocks are computed and pushed first (``_push_partial_products``), the own
    block is computed while they travel, and the received partial sums are added to it once the
    barrier is passed (each block rounded to the input's dtype before the sum, as in NCCL's
    reduce-scatter). Elsewhere the product, then the reduce-scatter.
    """
    if not _uses_peer_memory(a, group):
        return reduce_scatter_along_first_dim(a.matmul(matrix), group)
    peers = _peer_buffers(group)
    own_rows, received, outgoing = _push_partial_products(a.reshape(-1, a.shape[-1]), matrix, peers)
    block = torch.mm(own_rows, matrix)  # [n / k, p]
    torch.cuda.current_stream().wait_stream(peers.stream)
    del outgoing  # the side stream's reads of it are done
    for partial in received:
        block += partial
    return block.view(a.shape[0] // peers.size, *a.shape[1:-1], matrix.shape[1])
