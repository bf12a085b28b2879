"""Small helpers of tensor parallelism: exact division, splits, vocabulary ranges, 1-D partitions, and
the plain (not autograd-aware) collectives of the TP group along the first dimension, and its
elementwise maximum (FP8's amaxes), and the asynchronous all-to-alls of DeepSpeed-Ulysses."""
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megatron.core.parallel_state import group_rank, group_size

# Collectives on flat tensors: all_gather_single / reduce_scatter_single, or all_gather_into_tensor /
# reduce_scatter_tensor where this torch lacks them.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def start_all_gather_along_first_dim(tensor: torch.Tensor, group: ProcessGroup) -> tuple[torch.Tensor, object]:
    """all_gather_along_first_dim launched asynchronously: (output, work); the output is valid after
    ``work.wait()``, which on GPU makes the current stream wait (the host does not block)."""
    tensor = tensor.contiguous()
    output = torch.empty((group_size(group) * tensor.shape[0], *tensor.shape[1:]),
                         dtype=tensor.dtype, device=tensor.device)
    return output, _all_gather_flat(output, tensor, group=group, async_op=True)


def all_gather_along_first_dim(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[n, ...] on each of the k ranks of ``group`` -> [k * n, ...], rank order (not autograd-aware)."""
    if group_size(group) == 1:
        return tensor
    output, work = start_all_gather_along_first_dim(tensor, group)
    work.wait()
    return output


def start_reduce_scatter_along_first_dim(tensor: torch.Tensor, group: ProcessGroup) -> tuple[torch.Tensor, object]:
    """reduce_scatter_along_first_dim launched asynchronously: (output, work), as above."""
    tensor = tensor.contiguous()
    output = torch.empty((divide(tensor.shape[0], group_size(group)), *tensor.shape[1:]),
                         dtype=tensor.dtype, device=tensor.device)
    return output, _reduce_scatter_flat(output, tensor, group=group, async_op=True)


def reduce_scatter_along_first_dim(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[k * n, ...] on each of the k ranks -> rank r's [n, ...] block of the sum over ranks (not
    autograd-aware)."""
    if group_size(group) == 1:
        return tensor
    output, work = start_reduce_scatter_along_first_dim(tensor, group)
    work.wait()
    return output


def start_all_to_all(blocks: torch.Tensor, group: ProcessGroup) -> tuple[torch.Tensor, object]:
    """blocks [k, ...] on each of the k ranks, block j for rank j, launched asynchronously: (received
    [k, ...], work), received[j] rank j's block for this rank, valid after ``work.wait()``."""
    blocks = blocks.contiguous()
    received = torch.empty_like(blocks)
    return received, dist.all_to_all_single(received, blocks, group=group, async_op=True)


def start_all_to_all_of_others(blocks: torch.Tensor, group: ProcessGroup) -> tuple[torch.Tensor, object]:
    """``start_all_to_all`` without this rank's own block: (received [k, ...], work), received[j] rank j's
    block for this rank after ``work.wait()`` for j != r, while received[r] is never written and blocks[r]
    never read (point-to-point sends and receives), so the caller may compute both beside the transfers."""
    rank, size = group_rank(group), group_size(group)
    received = torch.empty(blocks.shape, dtype=blocks.dtype, device=blocks.device)
    operations = []
    for j in range(size):
        if j != rank:
            peer = dist.get_global_rank(group, j)
            operations.append(dist.P2POp(dist.isend, blocks[j].contiguous(), peer, group))
            operations.append(dist.P2POp(dist.irecv, received[j], peer, group))
    return received, _AllOf(dist.batch_isend_irecv(operations))


class _AllOf:
    """Several started works waited on as one."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def start_all_reduce(tensor: torch.Tensor, group: ProcessGroup) -> object:
    """Sum ``tensor`` over the group in place, asynchronously: the work to wait on."""
    return dist.all_reduce(tensor, group=group, async_op=True)


def all_reduce_max(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """The elementwise maximum over the ranks of ``group``, in a new tensor (not autograd-aware)."""
    if group_size(group) == 1:
        return tensor
    result = tensor.clone()
    dist.all_reduce(result, op=dist.ReduceOp.MAX, group=group)
    return result


def divide(numerator: int, denominator: int) -> int:
    """numerator / denominator, raising ValueError unless the division is exact."""
    if denominator == 0 or numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> tuple[torch.Tensor, ...]:
    """[..., n] -> num_partitions views [..., n / num_partitions] (copies when contiguous is asked)."""
    last_dim_size = divide(tensor.shape[-1], num_partitions)
    chunks = torch.split(tensor, last_dim_size, dim=-1)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


class VocabUtility:
    """The vocabulary range [first, last) held by one rank when V is split evenly over the TP group."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int,
                                                  world_size: int) -> tuple[int, int]:
        del world_size  # the range depends only on the partition size and the rank
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int,
                                           world_size: int) -> tuple[int, int]:
        per_partition = divide(global_vocab_size, world_size)
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's chunk of the flattened tensor, zero-padded so that every rank holds ceil(n / k).

    The inverse is ``gather_split_1d_tensor(chunk, group, tensor.numel())``.
    """
    world_size = group_size(group)
    flat = tensor.detach().reshape(-1)
    chunk_size = -(-flat.numel() // world_size)
    padded = torch.nn.functional.pad(flat, (0, chunk_size * world_size - flat.numel()))
    return padded[group_rank(group) * chunk_size:(group_rank(group) + 1) * chunk_size].clone()


def gather_split_1d_tensor(chunk: torch.Tensor, group: ProcessGroup | None, numel: int) -> torch.Tensor:
    """All-gather the 1-D chunks of ``split_tensor_into_1d_equal_chunks`` into the flat tensor [numel]."""
    if group_size(group) == 1:
        return chunk[:numel]
    return all_gather_along_first_dim(chunk, group)[:numel]
