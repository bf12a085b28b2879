"""Cross entropy over logits whose vocabulary dimension is split across the TP group.

For one token with logits z (over the full vocabulary V) and target t:

    loss = log sum_j exp(z_j - m) - (z_t - m),   m = max_j z_j
    dloss/dz_j = softmax(z)_j - [j == t]

Rank r holds z restricted to its vocabulary range [r V / k, (r + 1) V / k). The max, the target logit
(found on exactly one rank) and the sum of exponentials are combined by all-reduces of [s, b]
tensors: the [s, b, V] logits are never gathered. All arithmetic is in fp32 after subtracting the
global max, so logits of any magnitude (e.g. around 1e4) give finite, accurate losses.

On a GPU the fused version (``_FusedVocabParallelCrossEntropy``) computes the same loss without the
[s, b, v/k] fp32 temporaries: per rank one read of the logits forward, one read and one write backward.
"""
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megatron.core.fused_kernels.selection import fused_or_reference, kernel_module
from megatron.core.fused_kernels.training_ops import cross_entropy_constraint_violation
from megatron.core.parallel_state import group_rank, group_size
from megatron.core.tensor_parallel.utils import VocabUtility


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        logits_max = logits.detach().max(dim=-1).values.float()  # [s, b]
        if group is not None:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits.to(torch.float32, copy=True).sub_(logits_max.unsqueeze(-1))  # [s, b, v/k], ours

        vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            logits.shape[-1], group_rank(group), group_size(group))
        outside = (target < vocab_start) | (target >= vocab_end)  # [s, b]
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

        exp_logits = shifted.exp_()  # [s, b, v/k]
        # One all-reduce for both [s, b] sums: the target logit (on one rank) and the partition function.
        sums = torch.stack([target_logit, exp_logits.sum(dim=-1)])  # [2, s, b]
        if group is not None:
            dist.all_reduce(sums, group=group)
        target_logit, sum_exp = sums[0], sums[1]
        loss = torch.log(sum_exp) - target_logit  # [s, b]

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))  # [s, b, v/k]
        ctx.input_dtype = logits.dtype
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local_target = ctx.saved_tensors
        grad_logits = softmax  # [s, b, v/k]; reused in place (a second backward raises, as it should)
        one_hot_on_this_rank = (~outside).to(grad_logits.dtype).unsqueeze(-1)  # [s, b, 1]
        grad_logits.scatter_add_(-1, local_target.unsqueeze(-1), -one_hot_on_this_rank)
        grad_logits.mul_(grad_loss.unsqueeze(-1))
        return grad_logits.to(ctx.input_dtype), None, None


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """The same loss from the Triton kernels (fused_kernels/triton_cross_entropy.py): each rank sweeps
    its slice once for (m_r, s_r, z_t); then m = max_r m_r and s = sum_r s_r exp(m_r - m). Backward
    recomputes the softmax from the saved logits, m and s."""

    @staticmethod
    def forward(ctx, logits, target, group):
        kernels = _triton_kernels()
        logits2d = logits.reshape(-1, logits.shape[-1])  # [s * b, v/k]
        if logits2d.stride(-1) != 1:
            logits2d = logits2d.contiguous()
        target1d = target.reshape(-1).contiguous()
        vocab_start, _ = VocabUtility.vocab_range_from_per_partition_vocab_size(
            logits.shape[-1], group_rank(group), group_size(group))
        row_max, row_sum, target_logit = kernels.slice_statistics(logits2d, target1d, vocab_start)
        global_max = row_max
        if group is not None:
            global_max = row_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
            sums = torch.stack([target_logit, row_sum * torch.exp(row_max - global_max)])  # [2, s * b]
            dist.all_reduce(sums, group=group)
            target_logit, row_sum = sums[0], sums[1]
        loss = torch.log(row_sum) - (target_logit - global_max)  # [s * b]; z_t - m first: no rounding to ulp(m)
        ctx.save_for_backward(logits2d, target1d, global_max, row_sum)
        ctx.vocab_start, ctx.logits_shape = vocab_start, logits.shape
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits2d, target1d, global_max, row_sum = ctx.saved_tensors
        grad_logits = _triton_kernels().cross_entropy_backward(
            logits2d, target1d, global_max, row_sum, grad_loss.reshape(-1).float().contiguous(), ctx.vocab_start)
        return grad_logits.view(ctx.logits_shape), None, None


def _triton_kernels():
    return kernel_module("triton_cross_entropy")


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 tp_group: ProcessGroup | None) -> torch.Tensor:
    """Per-token loss [s, b] from logits [s, b, v/k] split over ``tp_group`` and targets [s, b].

    Targets must be ids of the full vocabulary, in [0, V); mask padded or ignored positions in the
    loss afterwards (a loss mask), not with a special id. The loss is fp32 whatever the logits' dtype.
    On a GPU the Triton kernels compute it when the fused kernels may run (fused_kernels.selection).
    """
    if logits.dim() == 3 and not logits.is_contiguous() and logits.transpose(0, 1).is_contiguous():
        # a batch-first view of sequence-first logits (the pipeline's head under sequence
        # parallelism): the loss is per token, so compute it on the logits as they lie in memory
        # rather than copying them (and their gradient) into the view's order
        return vocab_parallel_cross_entropy(logits.transpose(0, 1), target.transpose(0, 1), tp_group).transpose(0, 1)
    group = tp_group if group_size(tp_group) > 1 else None
    return fused_or_reference(
        "triton_cross_entropy", (logits, target), lambda: cross_entropy_constraint_violation(logits),
        lambda kernels: _FusedVocabParallelCrossEntropy.apply(logits, target, group),
        lambda: _VocabParallelCrossEntropy.apply(logits, target, group))
