"""Steps of DeepSpeed's engine that the trainer completes: the fp32 step's guard, the zero count of
the gradient, the synchronization of TP-duplicated parameters. Each is a declared replacement
(replacements.py)."""
import contextlib
import math

import torch

from megatron.core.parallel_state import ParallelGroups
from megatron.training.dist_utils import broadcast_from_first_rank, gather_objects, max_across_ranks, sum_across_group
from megatron.training.engine.model_setup import counts_once
from megatron.training.engine.replacements import replace
from megatron.training.engine.zero3 import is_partitioned


def gradient_norm_share(parameters, tp_rank: int) -> float:
    """This rank's part of sum(g^2) over the model's distinct gradients: TP-split parameters on every TP
    rank, replicated ones on TP rank 0, the pipeline's second tied copy (``ds_pipe_replicated``) never."""
    squares = [p.grad.detach().float().pow(2).sum() for p in parameters
               if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)
               and (getattr(p, "tensor_model_parallel", False) or tp_rank == 0)]
    return float(torch.stack(squares).sum()) if squares else 0.0


def guard_fp32_steps(engine, groups: ParallelGroups) -> None:
    """The fp32 optimizer step without ZeRO and without mixed precision, made as safe as DeepSpeed's
    ZeRO and bf16 optimizers: an exact global-norm clip, and no update on a NaN or Inf gradient.

    DeepSpeed's own clip (``runtime.utils.clip_grad_norm_``) counts replicated parameters only on the
    first rank of the TP x PP group, so with pipeline parallelism the other stages' norm weights and
    biases drop out of the norm and the tied embedding counts twice, and it discards the norm; and
    this path applies a NaN gradient. Here, before every step, ||g|| = sqrt(sum over the TP x PP
    group of ``gradient_norm_share``) is kept for ``engine.get_global_grad_norm()``; if it is not
    finite, the gradients are dropped and the optimizer's ``overflow`` tells the engine to count a
    skipped step and leave the learning rate (as for an fp16 overflow); else every gradient is scaled
    by min(1, clip / (||g|| + 1e-6)) as DeepSpeed does, when clipping is on.
    """
    model_parallel_group = groups.process_groups["model_parallel"]
    optimizer = engine.optimizer
    apply_step = optimizer.step

    def guarded_step(*args, **kwargs):
        parameters = [p for p in engine.module.parameters() if p.grad is not None]
        share = gradient_norm_share(parameters, groups.tp_rank)
        norm = math.sqrt(sum_across_group([share], model_parallel_group)[0])
        engine._global_grad_norm = norm
        optimizer.overflow = not math.isfinite(norm)
        if optimizer.overflow:
            optimizer.zero_grad(set_to_none=True)
            return None
        if engine.gradient_clipping() > 0.0:
            coefficient = min(1.0, engine.gradient_clipping() / (norm + 1e-6))
            for param in parameters:
                param.grad.mul_(coefficient)
        return apply_step(*args, **kwargs)

    if replace("fp32_steps.guard_fp32_steps", engine, "clip_fp32_gradients", lambda: None):  # clip in guarded_step
        optimizer.overflow = False
        optimizer.step = guarded_step


def count_zero_gradients(module: torch.nn.Module, groups: ParallelGroups) -> int:
    """Collective: the zeros of the whole model's gradient, as the optimizer is about to apply it
    (reduced over DP, unscaled zeros being zeros, before clipping). Each distinct parameter counts
    once: TP-split ones on every TP rank (their slices are disjoint), replicated ones on TP rank 0,
    the pipeline's second tied copy never; DeepSpeed's ``safe_get_full_grad`` assembles a parameter's
    gradient from ZeRO's partitions or the bf16 optimizer's fp32 buffer (an all-reduce over DP)."""
    from deepspeed.utils import safe_get_full_grad

    zeros = 0
    for name, param in module.named_parameters():
        gradient = safe_get_full_grad(param)  # collective under ZeRO: every rank asks for every parameter
        distinct = counts_once(name, groups) and (getattr(param, "tensor_model_parallel", False) or groups.tp_rank == 0)
        if gradient is not None and distinct:
            zeros += int((gradient == 0).sum())
    return int(sum_across_group([zeros], groups.process_groups["model_parallel"])[0])


def count_zeros_before_each_step(engine, groups: ParallelGroups) -> None:
    """--log-num-zeros-in-grad: ``engine.num_zeros_in_grad`` holds the count of the last step's gradient."""
    take_step = engine._take_model_step

    def counted_step(*args, **kwargs):
        engine.num_zeros_in_grad = count_zero_gradients(engine.module, groups)
        return take_step(*args, **kwargs)

    engine.num_zeros_in_grad = None
    replace("fp32_steps.count_zeros_before_each_step", engine, "_take_model_step", counted_step)


def tp_duplicated_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters every TP rank holds whole (layer norms, row-parallel and output biases, position
    embeddings): not ``tensor_model_parallel``."""
    return [(name, param) for name, param in module.named_parameters()
            if not getattr(param, "tensor_model_parallel", False)]


def synchronize_tp_duplicates(module: torch.nn.Module, groups: ParallelGroups) -> tuple[float, str | None]:
    """Collective: make every TP rank's copy of each TP-duplicated parameter equal TP rank 0's, bit for
    bit, in the optimizer's fp32 master (ZeRO partitions or bf16 buffers, through DeepSpeed's
    safe_get/set_full_fp32_param) and in the model (a ZeRO-3 parameter gathered, written and partitioned
    again); return (largest |difference| found, its name)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param
    from deepspeed.runtime.zero import GatheredParameters

    worst, worst_name = 0.0, None
    for name, param in tp_duplicated_parameters(module):
        master = safe_get_full_fp32_param(param)  # collective under ZeRO
        value = (master if master is not None else param.data).detach().clone()
        reference = broadcast_from_first_rank(value, groups.process_groups["tp"])
        difference = float((value.float() - reference.float()).abs().max()) if value.numel() else 0.0
        if difference > worst:
            worst, worst_name = difference, name
        if master is not None:
            safe_set_full_fp32_param(param, reference)
        gathered = GatheredParameters([param], modifier_rank=0) if is_partitioned(param) else contextlib.nullcontext()
        with gathered:
            param.data.copy_(reference.to(param.dtype))
    if max_across_ranks(worst) == 0.0:
        return 0.0, None
    return max(gather_objects((worst, worst_name)), key=lambda found: found[0])  # rare: name where it was


def synchronize_after_each_step(engine, groups: ParallelGroups) -> None:
    """--sync-tp-duplicated-parameters: after every optimizer step; ``engine.tp_drift`` holds what the
    last synchronization found (0.0 when the copies were already equal)."""
    take_step = engine._take_model_step

    def synchronized_step(*args, **kwargs):
        result = take_step(*args, **kwargs)
        engine.tp_drift = synchronize_tp_duplicates(engine.module, groups)
        return result

    engine.tp_drift = (0.0, None)
    replace("fp32_steps.synchronize_after_each_step", engine, "_take_model_step", synchronized_step)
