"""Autograd collectives that enter and leave tensor-parallel regions.

Each function pairs a forward collective with its conjugate (adjoint) in backward, so that the
gradient of a rank's local computation is the gradient of the global one:

    function                                    forward                   backward
    copy_to_tensor_model_parallel_region        identity                  all-reduce (sum)
    reduce_from_tensor_model_parallel_region    all-reduce (sum)          identity
    scatter_to_tensor_model_parallel_region     split last dim, keep mine all-gather last dim
    gather_from_tensor_model_parallel_region    all-gather last dim       split last dim, keep mine

Sequence parallelism (activations [s, b, h] split along the sequence, dim 0, outside the TP regions):

    function                                    forward                   backward
    scatter_to_sequence_parallel_region         split dim 0, keep mine    all-gather dim 0
    gather_from_sequence_parallel_region        all-gather dim 0          reduce-scatter dim 0
    reduce_scatter_to_sequence_parallel_region  reduce-scatter dim 0      all-gather dim 0

The gather feeds a column-parallel GEMM (or the vocabulary-parallel head): every rank's gradient of
the gathered X is a partial sum, so the adjoint sums them and hands each rank its block. The
reduce-scatter leaves a row-parallel GEMM: sum of the partial products, each rank keeping its block.

The group is explicit; ``group=None`` or a group of one rank makes every function the identity.
"""
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megatron.core.parallel_state import group_rank, group_size
from megatron.core.tensor_parallel.utils import (all_gather_along_first_dim, reduce_scatter_along_first_dim,
                                                 split_tensor_along_last_dim)


def _all_reduce(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum over the group into a new tensor (the input may be saved by autograd elsewhere)."""
    reduced = tensor.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(reduced, group=group)
    return reduced


def _split_along_last_dim(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[..., n] -> this rank's [..., n / k]."""
    chunks = split_tensor_along_last_dim(tensor, group_size(group))
    return chunks[group_rank(group)].contiguous()


def _gather_along_last_dim(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[..., n] on each of k ranks -> [..., k * n], rank r's block at [r * n, (r + 1) * n)."""
    stacked = all_gather_along_first_dim(tensor.unsqueeze(0), group)  # [k, ..., n]
    return stacked.movedim(0, -2).reshape(*tensor.shape[:-1], -1)  # [..., k, n] -> [..., k * n]


def _split_along_first_dim(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[s, ...] -> this rank's [s / k, ...] block (a view; contiguous since dim 0 is outermost)."""
    world_size = group_size(group)
    if tensor.shape[0] % world_size != 0:
        raise ValueError(f"--sequence-parallel splits the sequence over the {world_size} tensor-parallel ranks: "
                         f"the sequence length {tensor.shape[0]} must be divisible by "
                         f"--tensor-model-parallel-size ({world_size})")
    block = tensor.shape[0] // world_size
    return tensor[group_rank(group) * block:(group_rank(group) + 1) * block]


class _CopyToTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad_output):
        return _all_reduce(grad_output, ctx.group), None


class _ReduceFromTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        return _all_reduce(tensor, group)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


class _ScatterToTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _split_along_last_dim(tensor, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output, ctx.group), None


class _GatherFromTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _gather_along_last_dim(tensor, group)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_last_dim(grad_output, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return _split_along_first_dim(tensor, group).clone()

    @staticmethod
    def backward(ctx, grad_output):
        return all_gather_along_first_dim(grad_output, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return all_gather_along_first_dim(tensor, group)

    @staticmethod
    def backward(ctx, grad_output):
        return reduce_scatter_along_first_dim(grad_output, ctx.group), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return reduce_scatter_along_first_dim(tensor, group)

    @staticmethod
    def backward(ctx, grad_output):
        return all_gather_along_first_dim(grad_output, ctx.group), None


def copy_to_tensor_model_parallel_region(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Y = X on every rank; dL/dX = sum over ranks of dL/dY (X is replicated, used by all ranks)."""
    if group_size(group) == 1:
        return tensor
    return _CopyToTensorModelParallelRegion.apply(tensor, group)


def reduce_from_tensor_model_parallel_region(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Y = sum over ranks of X_r; dL/dX_r = dL/dY (Y is replicated)."""
    if group_size(group) == 1:
        return tensor
    return _ReduceFromTensorModelParallelRegion.apply(tensor, group)


def scatter_to_tensor_model_parallel_region(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """[..., n] replicated -> rank r keeps [..., r * n / k : (r + 1) * n / k]; backward all-gathers."""
    if group_size(group) == 1:
        return tensor
    return _ScatterToTensorModelParallelRegion.apply(tensor, group)


def gather_from_tensor_model_parallel_region(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """[..., n / k] per rank -> [..., n] replicated, blocks in rank order; backward keeps my block."""
    if group_size(group) == 1:
        return tensor
    return _GatherFromTensorModelParallelRegion.apply(tensor, group)


def scatter_to_sequence_parallel_region(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """[s, ...] replicated -> rank r keeps [r s / k : (r + 1) s / k, ...]; backward all-gathers."""
    if group_size(group) == 1:
        return tensor
    return _ScatterToSequenceParallelRegion.apply(tensor, group)


def gather_from_sequence_parallel_region(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """[s / k, ...] per rank -> [s, ...] on every rank, blocks in rank order; dL/dX_r = rank r's block
    of the sum over ranks of dL/dY (reduce-scatter): Y feeds a TP-split computation."""
    if group_size(group) == 1:
        return tensor
    return _GatherFromSequenceParallelRegion.apply(tensor, group)


def reduce_scatter_to_sequence_parallel_region(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """[s, ...] partial per rank -> rank r's [s / k, ...] block of the sum over ranks; backward all-gathers."""
    if group_size(group) == 1:
        return tensor
    return _ReduceScatterToSequenceParallelRegion.apply(tensor, group)


def allreduce_sequence_parallel_gradients(module: torch.nn.Module, group: ProcessGroup | None) -> int:
    """Sum over the TP group the gradient of every parameter of ``module`` marked ``sequence_parallel``
    (replicated weights applied to one rank's block of the sequence: layer norms, row-parallel
    biases), as it is computed in backward, before it reaches ``.grad`` or DeepSpeed's buffers; the
    sum is the gradient of the whole sequence, the same on every rank. Returns how many are hooked."""
    if group_size(group) == 1:
        return 0
    marked = [param for param in module.parameters() if getattr(param, "sequence_parallel", False)]
    for param in marked:
        param.register_hook(lambda grad: _all_reduce(grad, group))
    return len(marked)


# Plain transfers for inference (no autograd): activations between pipeline stages, and a tensor
# shared from one rank. Ranks are global; ``group=None`` in broadcast_from_rank is the identity.


def send_to_rank(tensor: torch.Tensor, destination: int) -> None:
    """Blocking point-to-point send of ``tensor`` to global rank ``destination``."""
    dist.send(tensor.contiguous(), destination)


def receive_from_rank(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, source: int) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` that global rank ``source`` sends (send_to_rank)."""
    received = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(received, source)
    return received


def broadcast_from_rank(tensor: torch.Tensor, source: int, group: ProcessGroup | None) -> torch.Tensor:
    """Global rank ``source``'s ``tensor`` on every rank of ``group`` (in place; returned). The tensor
    must be contiguous: a strided view would travel in storage order and land permuted."""
    if not tensor.is_contiguous():
        raise ValueError("broadcast_from_rank needs a contiguous tensor")
    if group_size(group) > 1:
        dist.broadcast(tensor, src=source, group=group)
    return tensor
