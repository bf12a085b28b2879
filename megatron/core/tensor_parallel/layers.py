"""Tensor-parallel linear layers and the vocabulary-parallel embedding.

Weights are stored [output, input] as in ``torch.nn.Linear``; each rank of a TP group of size k holds
one slice of the full weight and marks it with the attributes ``tensor_model_parallel`` (bool),
``partition_dim`` and ``partition_stride`` so that checkpoint tools can merge or re-split it.

Initialization. With ``use_cpu_initialization`` the FULL master weight is built on CPU in fp32,
``init_method`` fills it, and each rank keeps its slice: the gathered weights are the same for every
k (given the same CPU generator state). Without it, ``init_method`` fills the local slice directly,
under the model-parallel RNG fork so that slices differ across TP ranks (Megatron's GPU path; call
``random.model_parallel_seed`` first).
"""
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from megatron.core import fused_kernels
from megatron.core.parallel_state import group_rank, group_size
from megatron.core.tensor_parallel.fp8 import Fp8Config
from megatron.core.tensor_parallel.fp8_linear import Fp8Gemms, fp8_gathered_linear, fp8_linear, fp8_scattered_linear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.random import get_rng_tracker
from megatron.core.tensor_parallel.async_tp import (all_gather_matmul, all_gather_matmul_each_block,
                                                    matmul_reduce_scatter, start_matmul_reduce_scatter)
from megatron.core.tensor_parallel.utils import (VocabUtility, all_gather_along_first_dim, divide,
                                                 start_all_gather_along_first_dim, start_all_reduce,
                                                 start_reduce_scatter_along_first_dim)

InitMethod = Callable[[torch.Tensor], None]


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """Mark how ``tensor`` is sliced across the TP group (read by checkpoint merge tools)."""
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def _check_comm_overlap(layer: str, sequence_parallel: bool, comm_overlap: bool) -> None:
    if comm_overlap and not sequence_parallel:
        raise ValueError(f"{layer}: comm_overlap pipelines the collectives of sequence parallelism; "
                         "it needs sequence_parallel=True")


def _fp8_gemms(fp8: Fp8Config | None, parallel_dim: str, tp_group: ProcessGroup | None,
               device: torch.device | str | None) -> Fp8Gemms | None:
    return None if fp8 is None else Fp8Gemms(fp8, parallel_dim, tp_group, device)


def _fp8_state_for_load(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """A load_state_dict pre-hook of the linear layers: a state whose FP8 entries (``fp8_gemms.*``,
    delayed scaling's amax history and scales) are not the ones this layer has (a checkpoint with or
    without FP8, another recipe or history length) loads the weights and leaves the layer's own FP8
    state as it is: the saved FP8 entries are dropped, the missing ones start fresh. The trainer
    prints the notice (megatron/training/fp8_steps.py)."""
    fp8_prefix = prefix + "fp8_gemms."
    saved = {key: value for key, value in state_dict.items() if key.startswith(fp8_prefix)}
    own = {} if module.fp8_gemms is None else {fp8_prefix + key: value
                                               for key, value in module.fp8_gemms.state_dict().items()}
    if saved.keys() == own.keys() and all(saved[key].shape == own[key].shape for key in own):
        return
    for key in saved:
        del state_dict[key]
    state_dict.update({key: value.clone() for key, value in own.items()})


def _slice_of_master(master: torch.Tensor, partition_dim: int, stride: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's slice of a full weight split along ``partition_dim``.

    With stride s the dimension is cut into k * s blocks and rank r keeps blocks r, r + k, r + 2k, ...:
    a fused weight [A_1; ...; A_s] (e.g. Q, K, V stacked) is then split as each A_i separately.
    """
    block = divide(master.shape[partition_dim], world_size * stride)
    blocks = torch.split(master, block, dim=partition_dim)
    return torch.cat(blocks[rank::world_size], dim=partition_dim)


def _init_weight(weight: nn.Parameter, full_shape: tuple[int, int], partition_dim: int, stride: int,
                 init_method: InitMethod, use_cpu_initialization: bool, tp_group: ProcessGroup | None) -> None:
    """Fill the local slice ``weight`` of a weight of ``full_shape``; see the module docstring."""
    set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=stride)
    with torch.no_grad():
        if use_cpu_initialization:
            master = torch.empty(full_shape, dtype=torch.float32, device="cpu")
            init_method(master)
            local = _slice_of_master(master, partition_dim, stride, group_rank(tp_group), group_size(tp_group))
            weight.copy_(local)
        else:
            with get_rng_tracker().fork():
                init_method(weight)


class _ColumnParallelMatmul(torch.autograd.Function):
    """Y = X W^T + b for the column-parallel layer, X = this rank's input (whole, or under sequence
    parallelism its block [s / k, ...] that forward all-gathers), with the backward collective
    overlapped with the weight-gradient GEMM:

        dX = dY W          then launched: all-reduce over the group (or reduce-scatter along s)
        dW = dY^T X        computed while the collective runs, then waited for
        db = sum of dY

    Under sequence parallelism only the local block of X is saved: backward all-gathers it again,
    while dY W runs, so the activation memory of the gathered input is not held between passes.
    With ``comm_overlap`` (sequence parallelism only) the gather is pipelined with the GEMM in
    forward and the gathered X kept; backward's dX = dY W is pipelined with its reduce-scatter.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, comm_overlap):
        ctx.group, ctx.sequence_parallel, ctx.comm_overlap = group, sequence_parallel, comm_overlap
        if comm_overlap:
            total, y = all_gather_matmul(x, weight.t(), group, bias)  # [s, .., in], [s, .., out]
            ctx.save_for_backward(total, weight)
            return y
        ctx.save_for_backward(x, weight)
        total = all_gather_along_first_dim(x, group) if sequence_parallel else x  # [s, .., in]
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.comm_overlap:
            return _ColumnParallelMatmul.overlapped_backward(ctx, grad_output)
        x, weight = ctx.saved_tensors
        group = ctx.group
        if ctx.sequence_parallel:
            total, gather = start_all_gather_along_first_dim(x, group)  # overlaps dY W
        else:
            total, gather = x, None
        grad_input = grad_output.matmul(weight)  # [s, .., in], this rank's partial sum
        if ctx.sequence_parallel:
            grad_input, reduction = start_reduce_scatter_along_first_dim(grad_input, group)  # [s / k, .., in]
        else:
            reduction = start_all_reduce(grad_input, group)
        if gather is not None:
            gather.wait()
        grad_weight, grad_bias = _weight_and_bias_grads(grad_output, total, weight, ctx.needs_input_grad[2])
        reduction.wait()
        return grad_input, grad_weight, grad_bias, None, None, None

    @staticmethod
    def overlapped_backward(ctx, grad_output):
        total, weight = ctx.saved_tensors  # [s, .., in] gathered in forward, [out, in]
        grad_input, reduction = start_matmul_reduce_scatter(grad_output, weight, ctx.group)  # [s / k, .., in]
        grad_weight, grad_bias = _weight_and_bias_grads(grad_output, total, weight, ctx.needs_input_grad[2])
        reduction.wait()
        return grad_input, grad_weight, grad_bias, None, None, None


def _weight_and_bias_grads(grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                           bias_needs_grad: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dW = dY^T X [out, in] and db = sum of dY over every row (None when no bias needs it).

    A weight with a ``main_grad`` (its gradient accumulator, set by the trainer: DeepSpeed's fp32
    buffer under bf16) gets dW added there by the GEMM itself, and None is returned for it: on CUDA
    cuBLAS computes main_grad + dY^T X with fp32 output (beta = 1), so no bf16 dW is written, read
    back and added per micro-batch, and dW is never rounded to bf16; elsewhere the product is added.
    """
    grad_output_2d = grad_output.reshape(-1, grad_output.shape[-1])  # [s * .., out]
    grad_bias = grad_output_2d.sum(dim=0) if bias_needs_grad else None
    x_2d = x.reshape(-1, x.shape[-1])  # [s * .., in]
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        return grad_output_2d.t().matmul(x_2d), grad_bias
    if main_grad.is_cuda:
        torch.addmm(main_grad, grad_output_2d.t(), x_2d, out_dtype=main_grad.dtype, out=main_grad)
    else:
        main_grad.add_(grad_output_2d.t().matmul(x_2d))
    return None, grad_bias


class _LocalMatmul(torch.autograd.Function):
    """Y = X W^T + b on this rank alone (no collective), for weights with a ``main_grad``: backward
    adds dW into it (``_weight_and_bias_grads``) instead of returning dW to autograd; and for weights
    ``released_after_use``: it saves the parameter itself for backward, where torch's linear saves a
    view of its data (W^T), which keeps that data alive after the parameter lets it go."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_weight, grad_bias = _weight_and_bias_grads(grad_output, x, weight, ctx.needs_input_grad[2])
        return grad_output.matmul(weight), grad_weight, grad_bias


def local_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """X W^T + b on this rank: through ``_LocalMatmul`` when backward must add dW into ``weight.main_grad``
    or the weight is ``released_after_use`` (the trainer marks ZeRO-3's parameters so: their gathered data
    is freed after each forward and gathered again for backward)."""
    saves_itself = getattr(weight, "main_grad", None) is not None or getattr(weight, "released_after_use", False)
    if saves_itself and torch.is_grad_enabled() and weight.requires_grad:
        return _LocalMatmul.apply(x, weight, bias)
    return fused_kernels.linear(x, weight, bias)


class _RowParallelOverlappedMatmul(torch.autograd.Function):
    """Rank r's sequence block of sum over ranks of X_r A_r^T under sequence parallelism, the
    reduce-scatter pipelined with the GEMM (``matmul_reduce_scatter``); backward all-gathers dY
    pipelined with dX = dY A_r and with dA_r = dY^T X_r taken block by block of the sequence
    (``all_gather_matmul_each_block``), so that the gathered dY is never stored."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.group = group
        ctx.save_for_backward(x, weight)
        return matmul_reduce_scatter(x, weight.t(), group)  # [s / k, .., out]

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        x_blocks = x.reshape(-1, x.shape[-1]).split(grad_output[..., 0].numel())  # k blocks [s / k * .., in / k]
        grad_weights = []

        def add_weight_grad_of_block(q, grad_block):  # dA_r += dY_q^T X_q, X_q the rows of sequence block q
            grad_weight, _ = _weight_and_bias_grads(grad_block, x_blocks[q], weight, bias_needs_grad=False)
            if grad_weight is not None:
                grad_weights.append(grad_weight)

        grad_input = all_gather_matmul_each_block(grad_output, weight, ctx.group,
                                                  add_weight_grad_of_block)  # [s, .., in / k]
        return grad_input, sum(grad_weights) if grad_weights else None, None


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns across the k ranks of the TP group.

        A = [A_1, ..., A_k],  b = [b_1, ..., b_k],  rank r computes  Y_r = X A_r + b_r.

    X is replicated (its gradient is all-reduced over the group in backward); with
    ``sequence_parallel`` each rank passes its block of the sequence X_r [s / k, ...], all-gathered
    here (backward: reduce-scatter of the gradient). Either collective of backward overlaps the
    weight-gradient GEMM (``_ColumnParallelMatmul``); with ``comm_overlap`` (sequence parallelism)
    forward's gather and backward's reduce-scatter are pipelined with their GEMMs instead. The output stays split
    ([.., output_size / k]) unless ``gather_output``, which all-gathers it to [.., output_size].
    ``stride`` s splits each of s stacked sub-matrices of A separately (fused QKV), see
    ``_slice_of_master``. With ``skip_bias_add`` the bias is returned instead of added, so that a
    following fused kernel can add it. ``forward(x, bias_grad_by_caller=True)`` adds the bias but
    leaves its gradient to the caller, which sums it while reading dY anyway
    (``fused_kernels.split_query_key_value``) instead of a separate pass over dY here. With ``fp8``
    the three GEMMs run in FP8 (``fp8_linear``): the input is gathered (or its gradient all-reduced)
    by the mappings' collectives around them, without the overlaps above; with ``comm_overlap`` too,
    the gather and the reduce-scatter are pipelined with the FP8 GEMMs (``fp8_gathered_linear``).

    forward(x [.., input_size]) -> (y, bias or None).
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group: ProcessGroup | None, bias: bool = True,
                 gather_output: bool = False, init_method: InitMethod, use_cpu_initialization: bool = False,
                 params_dtype: torch.dtype = torch.float32, skip_bias_add: bool = False, stride: int = 1,
                 sequence_parallel: bool = False, comm_overlap: bool = False, fp8: Fp8Config | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        _check_comm_overlap(type(self).__name__, sequence_parallel, comm_overlap)
        if gather_output and stride > 1:
            raise ValueError("ColumnParallelLinear: gather_output with stride > 1 would interleave the strided "
                             "blocks of the output; keep the output split (gather_output=False)")
        if gather_output and skip_bias_add:
            raise ValueError("ColumnParallelLinear: skip_bias_add returns the local bias slice, which does not "
                             "match a gathered output; use gather_output=False or skip_bias_add=False")
        tp_size = group_size(tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, tp_size)
        self.tp_group, self.gather_output, self.skip_bias_add = tp_group, gather_output, skip_bias_add
        self.sequence_parallel, self.comm_overlap = sequence_parallel, comm_overlap
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size,
                                               dtype=params_dtype, device=device))
        _init_weight(self.weight, (output_size, input_size), 0, stride, init_method, use_cpu_initialization, tp_group)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, is_parallel=True, dim=0, stride=stride)
        else:
            self.register_parameter("bias", None)
        self.fp8_gemms = _fp8_gemms(fp8, "output", tp_group, device)
        self._register_load_state_dict_pre_hook(_fp8_state_for_load, with_module=True)

    def forward(self, x: torch.Tensor, bias_grad_by_caller: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = None if self.skip_bias_add else self.bias
        if bias is not None and bias_grad_by_caller:
            bias = bias.detach()
        if self.fp8_gemms is not None and self.comm_overlap and group_size(self.tp_group) > 1:
            y = fp8_gathered_linear(x, self.weight, bias, self.fp8_gemms, self.tp_group)  # [s, .., output_size / k]
        elif self.fp8_gemms is not None:
            y = fp8_linear(self._fp8_input(x), self.weight, bias, self.fp8_gemms)
        elif group_size(self.tp_group) == 1:
            y = local_linear(x, self.weight, bias)
        else:  # [s / k or s, .., input_size] -> [s, .., output_size / k]
            y = _ColumnParallelMatmul.apply(x, self.weight, bias, self.tp_group, self.sequence_parallel,
                                            self.comm_overlap)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.tp_group)  # [.., output_size]
        return y, (self.bias if self.skip_bias_add else None)

    def _fp8_input(self, x: torch.Tensor) -> torch.Tensor:
        """The whole input of the FP8 GEMMs: gathered along the sequence under sequence parallelism
        (backward: reduce-scatter), else X itself with its gradient all-reduced over the group."""
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(x, self.tp_group)  # [s, .., input_size]
        return copy_to_tensor_model_parallel_region(x, self.tp_group)

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, "
                f"per_partition={self.output_size_per_partition}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows across the k ranks of the TP group.

        A = [A_1; ...; A_k],  X = [X_1, ..., X_k],  Y = sum_r X_r A_r + b.

    Rank r holds A_r and receives X_r ([.., input_size / k]; with ``input_is_parallel=False`` it
    receives the full X and keeps its block). The partial products are all-reduced; b is replicated
    and added once after the reduction (or returned, with ``skip_bias_add``). With
    ``sequence_parallel`` they are reduce-scattered along the sequence instead (dim 0: y is rank r's
    [s / k, ..] block); b then meets only that block, so its gradient is partial and the bias is
    marked ``sequence_parallel`` for the TP all-reduce of such gradients (``allreduce_sequence_parallel_grads``).
    With ``comm_overlap`` that reduce-scatter, and backward's all-gather of dY, are pipelined with
    their GEMMs (``_RowParallelOverlappedMatmul``). With ``fp8`` the local product's three GEMMs run
    in FP8 (``fp8_linear``; with ``comm_overlap``, ``fp8_scattered_linear``).

    forward(x) -> (y [.., output_size], bias or None).
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group: ProcessGroup | None, bias: bool = True,
                 input_is_parallel: bool = True, init_method: InitMethod, use_cpu_initialization: bool = False,
                 params_dtype: torch.dtype = torch.float32, skip_bias_add: bool = False,
                 sequence_parallel: bool = False, comm_overlap: bool = False, fp8: Fp8Config | None = None,
                 device: torch.device | str | None = None):
        super().__init__()
        _check_comm_overlap(type(self).__name__, sequence_parallel, comm_overlap)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True (the input "
                             "comes from a column-parallel layer)")
        tp_size = group_size(tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.sequence_parallel, self.comm_overlap = sequence_parallel, comm_overlap
        self.input_size_per_partition = divide(input_size, tp_size)
        self.tp_group, self.input_is_parallel, self.skip_bias_add = tp_group, input_is_parallel, skip_bias_add
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition,
                                               dtype=params_dtype, device=device))
        _init_weight(self.weight, (output_size, input_size), 1, 1, init_method, use_cpu_initialization, tp_group)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.bias, is_parallel=False, dim=0, stride=1)
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)
        self.fp8_gemms = _fp8_gemms(fp8, "input", tp_group, device)
        self._register_load_state_dict_pre_hook(_fp8_state_for_load, with_module=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)  # [.., input_size / k]
        if self.comm_overlap and group_size(self.tp_group) > 1:  # -> [s / k, .., output_size]
            if self.fp8_gemms is not None:
                y = fp8_scattered_linear(x, self.weight, self.fp8_gemms, self.tp_group)
            else:
                y = _RowParallelOverlappedMatmul.apply(x, self.weight, self.tp_group)
            return self._add_bias(y)
        if self.fp8_gemms is not None:
            partial = fp8_linear(x, self.weight, None, self.fp8_gemms)
        else:
            partial = local_linear(x, self.weight)  # [.., output_size], this rank's X_r A_r
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)  # [s / k, .., output_size]
        else:
            y = reduce_from_tensor_model_parallel_region(partial, self.tp_group)
        return self._add_bias(y)

    def _add_bias(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.skip_bias_add:
            return y, self.bias
        if self.bias is not None:
            y = y + self.bias
        return y, None

    def extra_repr(self) -> str:
        return (f"input_size={self.input_size}, output_size={self.output_size}, "
                f"per_partition={self.input_size_per_partition}, input_is_parallel={self.input_is_parallel}")


def check_token_ids(ids: torch.Tensor, num_embeddings: int) -> None:
    """Raise ValueError unless every id lies in [0, num_embeddings). It reads the ids on the host:
    give it CPU tensors (a GPU tensor would synchronise the device).

    The minimum and maximum come from NumPy, on the calling thread: torch's CPU kernels split a
    batch of this size over the intra-op thread pool, whose threads, competing with the loader's
    workers and the other ranks for the cores, took ~10 ms to wake per operation (40 ms of host
    time per micro-batch in a TP=2 profile, before the first kernel of each iteration).
    """
    if ids.numel() == 0:
        return
    values = ids.cpu().numpy()  # integer ids: never part of autograd
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= num_embeddings:
        raise ValueError(f"token ids must lie in [0, {num_embeddings}) (the padded vocabulary), "
                         f"got min {low}, max {high}")


class VocabParallelEmbedding(nn.Module):
    """E[ids] with the table E [V, h] split by vocabulary rows across the k ranks of the TP group.

    Rank r holds rows [r V / k, (r + 1) V / k); it looks up the ids in its range, writes zeros for the
    others, and the all-reduce over the group assembles E[ids] (exactly one rank contributes each row).

    forward(ids [b, s]) -> [b, s, h]. Ids outside [0, V) raise ValueError when they are on the CPU
    (``check_token_ids``; GPU ids are checked by whoever moved them there).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group: ProcessGroup | None,
                 init_method: InitMethod, use_cpu_initialization: bool = False,
                 params_dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        super().__init__()
        tp_size = group_size(tp_group)
        self.num_embeddings, self.embedding_dim, self.tp_group = num_embeddings, embedding_dim, tp_group
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, group_rank(tp_group), tp_size)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim,
                                               dtype=params_dtype, device=device))
        _init_weight(self.weight, (num_embeddings, embedding_dim), 0, 1, init_method, use_cpu_initialization,
                     tp_group)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids on the GPU are not checked here: reading them back would stall the host every forward
        # (and cannot happen while a CUDA graph is captured); the trainer checks each batch on the CPU
        # before moving it (data_loading.get_batch), generation picks its tokens from the logits
        if not ids.is_cuda:
            check_token_ids(ids, self.num_embeddings)
        if group_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)  # [b, s]
        local_ids = (ids - self.vocab_start_index).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # [b, s, h]
        return reduce_from_tensor_model_parallel_region(partial, self.tp_group)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"per_partition={self.num_embeddings_per_partition}")
