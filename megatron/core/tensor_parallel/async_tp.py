"""Async tensor parallelism (--tp-comm-overlap): the TP group's collectives fused with the GEMMs that
consume or produce them, through symmetric GPU memory.

``all_gather_matmul`` (and its block-by-block form ``all_gather_matmul_each_block``) computes X B
with X gathered along the first dimension, and ``matmul_reduce_scatter`` (started and awaited apart
by ``start_matmul_reduce_scatter``) reduce-scatters A B: on CUDA the peer copies run on a side stream
beside the GEMMs, elsewhere (gloo) the plain collective and the product one after the other. The
parallel layers call them under ``comm_overlap``; the autograd collectives of the model's regions
live in ``mappings``. Underneath, ``all_gather_each_block`` hands each gathered block to the caller's
work as it arrives, and ``reduce_scatter_product`` (``start_reduce_scatter_product``) reduce-scatters
any ``RowBlockProduct``: the FP8 layers (``fp8_linear``) pass their quantized GEMMs through these.
"""
import functools
import socket
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megatron.core.parallel_state import group_rank, group_size
from megatron.core.tensor_parallel.utils import (all_gather_along_first_dim, divide, reduce_scatter_along_first_dim,
                                                 start_reduce_scatter_along_first_dim)


class _PeerBuffers:
    """Two slots of symmetric memory per group, the TP group or Ulysses' sequence-parallel group (each
    rank's slots writable by its peers over NVLink), used in turn by the fused collectives below, and a
    side stream for the peer copies (of high priority: its barrier kernel takes the first SM a GEMM
    beside it frees).

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
            raise RuntimeError("the group's GPUs cannot map each other's memory (symmetric memory: "
                               f"{error}); --tp-comm-overlap needs the TP group, the peer exchange of "
                               "DeepSpeed-Ulysses the sequence-parallel group, on one node with peer access "
                               "(NVLink or PCIe P2P)") from error
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


def host_identity() -> str:
    """This machine's name and boot id: equal for the processes of one host (containers included, where the
    kernel is shared), different across hosts that happen to share a name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def peers_reachable(places: list[tuple[str, str]], rank: int, visible: dict[str, int], can_access) -> bool:
    """Whether rank ``rank`` of a group whose ranks sit at ``places`` (host identity, GPU identity; by rank)
    can map every peer's memory: all on its host, each peer's GPU visible in this process (``visible``: GPU
    identity -> CUDA index here; a launcher that shows each process its own GPU alone hides them) and
    ``can_access(mine, theirs)`` by those indices."""
    host, device = places[rank]
    mine = visible.get(device)
    if mine is None:
        return False
    for other_host, other in places:
        theirs = visible.get(other)
        if other_host != host or theirs is None or (theirs != mine and not can_access(mine, theirs)):
            return False
    return True


def _gpu_identity(index: int) -> str:
    """A GPU's identity across processes: its UUID (the index where torch does not report one)."""
    return str(getattr(torch.cuda.get_device_properties(index), "uuid", index))


@functools.cache
def peer_memory_reaches(group: ProcessGroup) -> bool:
    """Whether the exchanges of ``group`` (its ranks on CUDA devices) can go through symmetric memory: every
    rank's GPU on one host, visible to each rank and able to map each peer's (``peers_reachable``), agreed
    by all ranks. A collective, once per group: every rank of the group calls it at the same point."""
    visible = {_gpu_identity(index): index for index in range(torch.cuda.device_count())}
    places = [None] * group_size(group)
    dist.all_gather_object(places, (host_identity(), _gpu_identity(torch.cuda.current_device())), group=group)
    reachable = peers_reachable(places, group_rank(group), visible, torch.cuda.can_device_access_peer)
    agreed = torch.tensor([float(reachable)], device="cuda")
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return bool(agreed.item())


def _uses_peer_memory(device: torch.device, group: ProcessGroup) -> bool:
    return device.type == "cuda" and group_size(group) > 1


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
    if not _uses_peer_memory(shard.device, group):
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


def all_gather_each_block(shard: torch.Tensor, group: ProcessGroup,
                          use_block: Callable[[int, torch.Tensor], None]) -> None:
    """Calls ``use_block(r, X_r)`` on each rank's block X_r [n, m] of X, the all-gather of the k ranks'
    ``shard`` [n, .., m] along dim 0 (r = 0 .. k - 1, in no fixed order), once it is here, to issue
    the work that reads it. A peer's block is its slot of symmetric memory, rewritten two calls
    later: the work must read it on the current stream before then, never keep it.

    On CUDA ``use_block``'s work on the own block runs beside the push of that block to the peers;
    then the peers' blocks, read from this rank's slot. Elsewhere the all-gather, then the blocks.
    """
    if not _uses_peer_memory(shard.device, group):
        gathered = all_gather_along_first_dim(shard, group)
        for rank, block in enumerate(gathered.reshape(-1, shard.shape[-1]).split(shard[..., 0].numel())):
            use_block(rank, block)
        return
    peers, current = _peer_buffers(group), torch.cuda.current_stream()
    x = shard.reshape(-1, shard.shape[-1])  # [n, m]
    received, arrived = _push_shard(x, peers)
    use_block(peers.rank, x)
    current.wait_event(arrived)
    for rank, block in received.items():
        use_block(rank, block)
    current.wait_stream(peers.stream)


def all_gather_matmul_each_block(shard: torch.Tensor, matrix: torch.Tensor, group: ProcessGroup,
                                 use_block: Callable[[int, torch.Tensor], None]) -> torch.Tensor:
    """X B as all_gather_matmul, without returning X: instead ``use_block(r, X_r)`` is called on each
    rank's block X_r [n, m] of X (``all_gather_each_block``) right after its product, to issue the
    work that reads it (the weight gradient's share of that block: dW = sum over r of dY_r^T X_r).

    On CUDA the own block's product and ``use_block``'s work on it both run beside the push of the
    block to the peers, more work to hide it behind than all_gather_matmul's one GEMM; the peers'
    blocks are read from this rank's slot, never copied out.
    """
    rows = shard[..., 0].numel()
    product = shard.new_empty(group_size(group) * rows, matrix.shape[1])  # [k n, p]

    def multiply_and_use(rank: int, block: torch.Tensor) -> None:
        torch.mm(block, matrix, out=product[rank * rows:(rank + 1) * rows])
        use_block(rank, block)

    all_gather_each_block(shard, group, multiply_and_use)
    return product.view(group_size(group) * shard.shape[0], *shard.shape[1:-1], matrix.shape[1])


class RowBlockProduct:
    """A B for A [n, m] and B [m, p], computed by blocks of A's rows, as the pipelined reduce-scatter
    needs it: ``into`` writes A[i:j] B into ``out``, ``add_into`` adds it there (cuBLAS's beta = 1: no
    separate add), ``whole`` is the plain product (the path of the plain collectives). The FP8
    layers subclass it to quantize each block on its way in (``fp8_linear``)."""

    def __init__(self, a: torch.Tensor, matrix: torch.Tensor):
        self.a, self.matrix = a, matrix
        self.rows, self.columns = a.shape[0], matrix.shape[1]
        self.dtype, self.device = a.dtype, a.device

    def into(self, start: int, end: int, out: torch.Tensor) -> None:
        torch.mm(self.a[start:end], self.matrix, out=out)

    def add_into(self, start: int, end: int, out: torch.Tensor) -> None:
        out.addmm_(self.a[start:end], self.matrix)

    def whole(self) -> torch.Tensor:
        return self.a.matmul(self.matrix)


def _push_partial_products(product: RowBlockProduct,
                           peers: _PeerBuffers) -> tuple[tuple[int, int], list[torch.Tensor], torch.Tensor]:
    """Compute the blocks of ``product`` [n, p] that the peers own, each pushed into its peer's slot
    (side stream) as soon as it is ready, then the barrier there: (this rank's own rows (start,
    end), the peers' blocks for this rank as they land in its slot, the outgoing blocks, which the
    side stream reads until the current stream waits for it)."""
    current = torch.cuda.current_stream()
    rows = divide(product.rows, peers.size)
    block_shape = torch.Size((rows, product.columns))
    block_bytes = rows * product.columns * product.dtype.itemsize
    offset = peers.next_slot(peers.size * block_bytes, product.device)  # a block per sending rank
    others = [rank for rank in range(peers.size) if rank != peers.rank]
    outgoing = torch.empty(len(others), *block_shape, dtype=product.dtype,
                           device=product.device)  # [k - 1, n / k, p]: the peers' blocks
    for index, rank in enumerate(others):
        product.into(rank * rows, (rank + 1) * rows, outgoing[index])
        peers.stream.wait_stream(current)
        with torch.cuda.stream(peers.stream):  # into the peer's slot, at this rank's place
            peers.view(rank, offset + peers.rank * block_bytes, block_shape, product.dtype).copy_(outgoing[index])
    with torch.cuda.stream(peers.stream):
        peers.barrier()  # past it, every peer's block for this rank has landed in its slot
    received = [peers.view(peers.rank, offset + rank * block_bytes, block_shape, product.dtype) for rank in others]
    return (peers.rank * rows, (peers.rank + 1) * rows), received, outgoing


class _OwnBlockAfterTransfers:
    """The end of a started reduce-scatter: ``wait()`` makes the current stream wait for the side
    stream (barrier, then the received partial sums copied into the output), then adds the rest
    of them and the own block's product, the latter by ``add_into`` (for plain matrices the GEMM
    itself, beta = 1). It holds the outgoing blocks until then: the side stream may still be
    reading them, and freed memory goes back to the current stream's pool."""

    def __init__(self, output: torch.Tensor, product: RowBlockProduct, own: tuple[int, int],
                 more_received: list[torch.Tensor], outgoing: torch.Tensor, peers: _PeerBuffers):
        self.output, self.product, self.own = output, product, own
        self.more_received, self.outgoing, self.peers = more_received, outgoing, peers

    def wait(self) -> None:
        torch.cuda.current_stream().wait_stream(self.peers.stream)
        self.outgoing = None
        for partial in self.more_received:
            self.output += partial
        self.product.add_into(*self.own, self.output)


class _SideStreamWork:
    """A collective running on a side stream: ``wait()`` makes the current stream wait for its end."""

    def __init__(self, done: torch.cuda.Event):
        self.done = done

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.done)


def start_peer_all_to_all(blocks: torch.Tensor, group: ProcessGroup, into: torch.Tensor | None = None,
                          with_own: bool = True) -> tuple[torch.Tensor, object]:
    """``start_all_to_all`` through symmetric memory: blocks [k, ...] (block j for rank j), launched on
    the side stream: (received [k, ...], work), received[j] rank j's block for this rank after
    ``work.wait()``; with ``into`` (a view of that shape, any strides) the blocks land there, on the
    side stream too, and it is returned as received. Without ``with_own``, received[r] is never
    written and blocks[r] never read (as ``start_all_to_all_of_others``).

    Pulled, not pushed: the side stream gathers the peers' blocks into this rank's slot (at their
    place), passes the group's barrier, then copies each peer's block for this rank out of that peer's
    slot (copy engines over NVLink: no SMs taken from the computation beside it) and its own block
    from ``blocks``. Everything ends on the side stream, so several may be in flight: a slot is written
    again two calls later, after the next call's barrier, which each peer passes only once its copies
    of this one are done (``_PeerBuffers``)."""
    peers, current = _peer_buffers(group), torch.cuda.current_stream()
    block_shape, dtype = blocks.shape[1:], blocks.dtype
    block_bytes = blocks[0].numel() * dtype.itemsize
    offset = peers.next_slot(peers.size * block_bytes, blocks.device)
    others = [rank for rank in range(peers.size) if rank != peers.rank]
    received = torch.empty(blocks.shape, dtype=dtype, device=blocks.device) if into is None else into
    peers.stream.wait_stream(current)
    with torch.cuda.stream(peers.stream):
        for rank in others:  # into this rank's slot, at the destination's place
            peers.view(peers.rank, offset + rank * block_bytes, block_shape, dtype).copy_(blocks[rank])
        peers.barrier()  # past it, every peer's slot holds its blocks of this call
        for rank in others:
            received[rank].copy_(peers.view(rank, offset + peers.rank * block_bytes, block_shape, dtype))
        if with_own:
            received[peers.rank].copy_(blocks[peers.rank])
        done = torch.cuda.Event()
        done.record()
    blocks.record_stream(peers.stream)  # a source freed before the copies end stays out of the current pool
    received.record_stream(peers.stream)
    return received, _SideStreamWork(done)


def start_reduce_scatter_product(product: RowBlockProduct, group: ProcessGroup) -> tuple[torch.Tensor, object]:
    """Rank r's block [n / k, p] of the sum over ranks of ``product`` [n, p], launched asynchronously:
    (output, work), the output valid after ``work.wait()``; work issued in between (the weight
    gradient) runs beside the transfers. No other fused collective of the group may come in
    between: the wait reads this call's slot, and the slots' reuse rule (``_PeerBuffers``) counts
    on those reads preceding the next call's barrier.

    On CUDA each rank computes the blocks of its partial product that its peers own; the side stream
    pushes each into that peer's symmetric memory as soon as it is ready (copy engines over NVLink),
    passes the group's barrier and copies the received partial sums into the output, all beside the
    caller's work. ``wait()`` then adds the own block's product into that sum. Elsewhere the
    product, then the asynchronous reduce-scatter.
    """
    if not _uses_peer_memory(product.device, group):
        return start_reduce_scatter_along_first_dim(product.whole(), group)
    peers = _peer_buffers(group)
    own, received, outgoing = _push_partial_products(product, peers)
    output = torch.empty(own[1] - own[0], product.columns, dtype=product.dtype, device=product.device)  # [n / k, p]
    with torch.cuda.stream(peers.stream):
        output.copy_(received[0])
    return output, _OwnBlockAfterTransfers(output, product, own, received[1:], outgoing, peers)


def reduce_scatter_product(product: RowBlockProduct, group: ProcessGroup) -> torch.Tensor:
    """Rank r's block [n / k, p] of the sum over ranks of ``product`` [n, p].

    On CUDA the peers' blocks are computed and pushed first (``_push_partial_products``), the own
    block is computed while they travel, and the received partial sums are added to it once the
    barrier is passed (each block rounded to the product's dtype before the sum, as in NCCL's
    reduce-scatter). Elsewhere the product, then the reduce-scatter.
    """
    if not _uses_peer_memory(product.device, group):
        return reduce_scatter_along_first_dim(product.whole(), group)
    peers = _peer_buffers(group)
    own, received, outgoing = _push_partial_products(product, peers)
    block = torch.empty(own[1] - own[0], product.columns, dtype=product.dtype, device=product.device)  # [n / k, p]
    product.into(*own, block)
    torch.cuda.current_stream().wait_stream(peers.stream)
    del outgoing  # the side stream's reads of it are done
    for partial in received:
        block += partial
    return block


def start_matmul_reduce_scatter(a: torch.Tensor, matrix: torch.Tensor,
                                group: ProcessGroup) -> tuple[torch.Tensor, object]:
    """matmul_reduce_scatter launched asynchronously (``start_reduce_scatter_product``): (output,
    work), the output valid after ``work.wait()``."""
    output, work = start_reduce_scatter_product(RowBlockProduct(a.reshape(-1, a.shape[-1]), matrix), group)
    return output.view(a.shape[0] // group_size(group), *a.shape[1:-1], matrix.shape[1]), work


def matmul_reduce_scatter(a: torch.Tensor, matrix: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Rank r's block [n / k, .., p] of sum over ranks of A B, A = ``a`` [n, .., m], B = ``matrix`` [m, p]
    (``reduce_scatter_product``)."""
    block = reduce_scatter_product(RowBlockProduct(a.reshape(-1, a.shape[-1]), matrix), group)
    return block.view(a.shape[0] // group_size(group), *a.shape[1:-1], matrix.shape[1])
