"""Autograd collectives that enter and leave tensor-parallel regions.

Each function pairs a forward collective with its conjugate (adjoint) in backward, so that the
gradient of a rank's local computation is the gradient of the global one:

    function                                    forward                   backward
    copy_to_tensor_model_parallel_region        identity                  all-reduce (sum)
    reduce_from_tensor_model_parallel_region    all-reduce (sum), in place identity
    scatter_to_tensor_model_parallel_region     split last dim, keep mine all-gather last dim
    gather_from_tensor_model_parallel_region    all-gather last dim       split last dim, keep mine

Sequence parallelism (activations [s, b, h] split along the sequence, dim 0, outside the TP regions):

    function                                    forward                   backward
    scatter_to_sequence_parallel_region         split dim 0, keep mine    all-gather dim 0
    gather_from_sequence_parallel_region        all-gather dim 0          reduce-scatter dim 0
    reduce_scatter_to_sequence_parallel_region  reduce-scatter dim 0      all-gather dim 0

DeepSpeed-Ulysses' exchanges, overlapped with attention, live in ``megatron.core.models.gpt.ulysses``;
its loss sums token counts over the sequence-parallel group with ``sum_over_group``.

The gather feeds a column-parallel GEMM (or the vocabulary-parallel head): every rank's gradient of
the gathered X is a partial sum, so the adjoint sums them and hands each rank its block. The
reduce-scatter leaves a row-parallel GEMM: sum of the partial products, each rank keeping its block.

The group is explicit; ``group=None`` or a group of one rank makes every function the identity.
The collectives fused with the GEMMs that consume or produce them (--tp-comm-overlap) are the
parallel layers' own, from ``async_tp``.
"""
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megatron.core.parallel_state import group_rank, group_size
from megatron.core.tensor_parallel.utils import (all_gather_along_first_dim, reduce_scatter_along_first_dim,
                                                 split_tensor_along_last_dim)


Collective = Callable[[torch.Tensor, ProcessGroup], torch.Tensor]  # (tensor, group) -> tensor


def _all_reduce_in_place(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum over the group in ``tensor`` itself: a fresh partial result that nothing else reads."""
    dist.all_reduce(tensor, group=group)
    return tensor


def _all_reduce(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum over the group into a new tensor (the input may be saved by autograd elsewhere)."""
    return _all_reduce_in_place(tensor.clone(memory_format=torch.contiguous_format), group)


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


def _identity(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return tensor.view_as(tensor)  # a view, so autograd sees a new output


def _scatter_along_first_dim(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return _split_along_first_dim(tensor, group).clone()  # the block alone, not the whole input's storage


def _conjugate_pair(name: str, forward: Collective, backward: Collective,
                    in_place: bool) -> type[torch.autograd.Function]:
    """The autograd function Y = forward(X, group), dL/dX = backward(dL/dY, group); ``in_place``: the
    forward writes Y into X."""
    def apply_forward(ctx, tensor, group):
        ctx.group = group
        if in_place:
            ctx.mark_dirty(tensor)
        return forward(tensor, group)

    def apply_backward(ctx, grad_output):
        return backward(grad_output, ctx.group), None

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(apply_forward), "backward": staticmethod(apply_backward)})


def _region(name: str, forward: Collective, backward: Collective, doc: str, in_place: bool = False) -> Collective:
    """The public function of one row of the module's table: the identity on a group of one rank.
    An ``in_place`` forward gets a copy of a leaf that requires grad (autograd forbids writing one)."""
    function = _conjugate_pair(f"_{name}", forward, backward, in_place)

    def region(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        if group_size(group) == 1:
            return tensor
        if in_place and tensor.is_leaf and tensor.requires_grad:
            tensor = tensor.clone()
        return function.apply(tensor, group)

    region.__name__ = region.__qualname__ = name
    region.__doc__ = doc
    return region


copy_to_tensor_model_parallel_region = _region(
    "copy_to_tensor_model_parallel_region", _identity, _all_reduce,
    "Y = X on every rank; dL/dX = sum over ranks of dL/dY (X is replicated, used by all ranks).")
reduce_from_tensor_model_parallel_region = _region(
    "reduce_from_tensor_model_parallel_region", _all_reduce_in_place, _identity,
    "Y = sum over ranks of X_r; dL/dX_r = dL/dY (Y is replicated). Summed in X_r's memory, as in\n"
    "Megatron-DeepSpeed: X_r is a fresh partial result (a row-parallel GEMM's, the embedding's) that\n"
    "nothing else reads; were it saved for another backward, that backward would raise.", in_place=True)
scatter_to_tensor_model_parallel_region = _region(
    "scatter_to_tensor_model_parallel_region", _split_along_last_dim, _gather_along_last_dim,
    "[..., n] replicated -> rank r keeps [..., r * n / k : (r + 1) * n / k]; backward all-gathers.")
gather_from_tensor_model_parallel_region = _region(
    "gather_from_tensor_model_parallel_region", _gather_along_last_dim, _split_along_last_dim,
    "[..., n / k] per rank -> [..., n] replicated, blocks in rank order; backward keeps my block.")
scatter_to_sequence_parallel_region = _region(
    "scatter_to_sequence_parallel_region", _scatter_along_first_dim, all_gather_along_first_dim,
    "[s, ...] replicated -> rank r keeps [r s / k : (r + 1) s / k, ...]; backward all-gathers.")
gather_from_sequence_parallel_region = _region(
    "gather_from_sequence_parallel_region", all_gather_along_first_dim, reduce_scatter_along_first_dim,
    "[s / k, ...] per rank -> [s, ...] on every rank, blocks in rank order; dL/dX_r = rank r's block\n"
    "of the sum over ranks of dL/dY (reduce-scatter): Y feeds a TP-split computation.")
reduce_scatter_to_sequence_parallel_region = _region(
    "reduce_scatter_to_sequence_parallel_region", reduce_scatter_along_first_dim, all_gather_along_first_dim,
    "[s, ...] partial per rank -> rank r's [s / k, ...] block of the sum over ranks; backward all-gathers.")


def sequence_parallel_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of ``module`` marked ``sequence_parallel``: replicated weights applied to one
    rank's block of the sequence (layer norms, row-parallel biases), whose gradients are partial."""
    return [param for param in module.parameters() if getattr(param, "sequence_parallel", False)]


def allreduce_sequence_parallel_gradients(module: torch.nn.Module, group: ProcessGroup | None) -> list:
    """Sum over the TP group the gradient of every ``sequence_parallel_parameters`` of ``module`` as
    it is computed in backward, before it reaches ``.grad`` or DeepSpeed's buffers; the sum is the
    gradient of the whole sequence, the same on every rank. Returns the hooks' removable handles."""
    if group_size(group) == 1:
        return []
    return [param.register_hook(lambda grad: _all_reduce(grad, group))
            for param in sequence_parallel_parameters(module)]


def sum_over_group(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """The sum over ``group`` of a tensor outside autograd (a count), as a new tensor."""
    if group_size(group) == 1:
        return tensor
    return _all_reduce(tensor.detach(), group)


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
