"""Model, optimizer, learning-rate schedule and the DeepSpeed engine that runs them (DeepSpeed is the engine:
docs/architecture.md, "Principles").

Which module DeepSpeed gets:

    PP > 1, ZeRO 0/1     GPTModelPipe (a PipelineModule): DeepSpeed's PipelineEngine, 1F1B schedule
    PP = 1, ZeRO 0/1     GPTModelPipe too, as Megatron-DeepSpeed always did: same checkpoint layout
                         (layer_XX-model_YY-model_states.pt) whatever the pipeline degree
    PP = 1, ZeRO 2       GPTModel, a plain module: DeepSpeed's PipelineEngine refuses ZeRO >= 2

The pipeline module is built on DeepSpeed's ``PipeModelDataParallelTopology(num_pp, num_mp=TP,
num_dp)``, whose rank grid is ours (parallel_state.py); ``check_engine_grid`` verifies that rank by
rank after ``deepspeed.initialize``. The plain module gets ``mpu=DeepSpeedMPU(groups)``.

Optimizer: ``--optimizer adam`` is Adam with decoupled weight decay (torch.optim.AdamW, fused on
CUDA): p <- p - lr * (m_hat / (sqrt(v_hat) + eps) + wd * p), with wd = 0 for biases and norm
weights; with --use-bnb-optimizer the same update by bitsandbytes' AdamW8bit (8-bit moments, 32-bit
for the word embedding); ``sgd`` is torch.optim.SGD with --sgd-momentum. DeepSpeed wraps it (ZeRO, BF16_Optimizer,
fp16 loss scaling) and clips gradients to the ds_config's gradient_clipping.

The learning rate follows AnnealingLR (lr_schedule.py), handed to ``deepspeed.initialize`` as the
engine's scheduler: the engine steps it after every *applied* optimizer step (an fp16 overflow
skips it), with the increment from the batch calculator (the current global batch, in samples) and
the consumed tokens from the trainer, and saves it in the checkpoint's ``lr_scheduler`` entry.
"""
import math
import re
from collections.abc import Callable

import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.layer_norm import LayerNorm
from megatron.core.parallel_state import DeepSpeedMPU, ParallelGroups
from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.training.engine.bf16_steps import (accumulate_bf16_gradients_in_one_kernel,
                                                    accumulate_linear_weight_gradients_in_their_gemms,
                                                    clip_inside_the_fused_adamw_step,
                                                    skip_the_one_rank_gradient_reduction,
                                                    take_the_gradient_norm_in_few_kernels,
                                                    write_the_bf16_weights_in_the_adamw_step)
from megatron.training.config import OptimizerConfig, ScheduleConfig, TrainConfig
from megatron.training.dist_utils import (broadcast_from_first_rank, gather_objects, max_across_ranks, print_rank_0,
                                         sum_across_group)
from megatron.training.lr_schedule import AnnealingLR


class EngineSetupError(RuntimeError):
    """The DeepSpeed engine does not match the configuration (rank grid, precision)."""


def uses_pipeline_engine(pipeline_model_parallel_size: int, zero_stage: int) -> bool:
    """GPTModelPipe on DeepSpeed's PipelineEngine unless ZeRO >= 2 (then PP is 1, validated at parse)."""
    return pipeline_model_parallel_size > 1 or zero_stage < 2


def current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def build_model(config: TrainConfig, groups: ParallelGroups) -> torch.nn.Module:
    """GPTModelPipe on DeepSpeed's topology of our grid, or GPTModel (see the module docstring)."""
    device = current_device() if torch.cuda.is_available() else None
    if not uses_pipeline_engine(groups.pp_size, config.parallel.zero_stage):
        return GPTModel(config.model, groups, device=device)
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from megatron.training.engine.pipeline_module import GPTModelPipe

    topology = PipeModelDataParallelTopology(num_pp=groups.pp_size, num_mp=groups.tp_size, num_dp=groups.dp_size)
    return GPTModelPipe(config.model, groups, topology, partition_method=config.parallel.pp_partition_method,
                        device=device)


def _is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, (LayerNorm, torch.nn.LayerNorm))


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two parameter groups: {weights, weight_decay} and {biases and norm weights, 0.0}.

    A parameter shared by several modules (the tied embedding) appears once.
    """
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            (no_decay if _is_norm(module) or name == "bias" else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, optimizer: OptimizerConfig,
                    offload_to_cpu: bool = False) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay, fused on CUDA) or SGD over ``weight_decay_groups``.

    With ZeRO's optimizer offload (``offload_to_cpu``) Adam is DeepSpeed's DeepSpeedCPUAdam in AdamW
    mode, the same update run by DeepSpeed's vectorised CPU kernel (compiled on first use): DeepSpeed
    refuses another optimizer there. With --use-bnb-optimizer it is bitsandbytes' AdamW8bit, the
    word embedding in a group of its own with 32-bit state (bnb_optimizer.py).
    """
    groups = weight_decay_groups(model, optimizer.weight_decay)
    betas = (optimizer.adam_beta1, optimizer.adam_beta2)
    if optimizer.use_bnb_optimizer:
        from megatron.training.bnb_optimizer import adamw_8bit, with_embedding_in_32_bits

        embeddings = [module.weight for module in model.modules() if isinstance(module, VocabParallelEmbedding)]
        groups = [group for group in with_embedding_in_32_bits(groups, embeddings) if group["params"]]
        return adamw_8bit(groups, lr=optimizer.lr, betas=betas, eps=optimizer.adam_eps, device=current_device())
    groups = [group for group in groups if group["params"]]
    if optimizer.optimizer == "adam" and offload_to_cpu:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(groups, lr=optimizer.lr, betas=betas, eps=optimizer.adam_eps, adamw_mode=True)
    if optimizer.optimizer == "adam":
        return torch.optim.AdamW(groups, lr=optimizer.lr, betas=betas, eps=optimizer.adam_eps,
                                 fused=torch.cuda.is_available())
    if optimizer.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=optimizer.lr, momentum=optimizer.sgd_momentum)
    raise ValueError(f"--optimizer {optimizer.optimizer!r} is not supported; use adam or sgd")


def build_lr_scheduler(torch_optimizer: torch.optim.Optimizer, optimizer: OptimizerConfig,
                       schedule: ScheduleConfig, increment_provider: Callable[[], int],
                       token_provider: Callable[[], int]) -> AnnealingLR:
    """AnnealingLR in samples; ``increment_provider`` gives the current global batch, ``token_provider``
    the consumed training tokens before the step (Megatron-DeepSpeed's lag, lr_schedule.py)."""
    return AnnealingLR(torch_optimizer, max_lr=optimizer.lr, min_lr=optimizer.min_lr,
                       warmup_steps=schedule.lr_warmup_steps, decay_steps=schedule.lr_decay_steps,
                       decay_style=schedule.lr_decay_style, warmup_tokens=schedule.lr_warmup_tokens,
                       decay_tokens=schedule.lr_decay_tokens, increment_provider=increment_provider,
                       token_provider=token_provider, source=schedule.lr_scheduler_source, report=print_rank_0)


def deepspeed_config(config: TrainConfig) -> dict:
    """The ds_config handed to deepspeed.initialize: the user's, completed by the arguments module
    (argument_ds_config.py: batch sizes, precision, clipping, ZeRO stage, SGD allowance)."""
    return config.deepspeed.config_for_initialize()


def is_pipeline_engine(engine) -> bool:
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return isinstance(engine, PipelineEngine)


def check_engine_grid(engine, groups: ParallelGroups) -> None:
    """Raise EngineSetupError unless DeepSpeed's view of the rank grid is ours, rank list by rank list.

    ``engine.grid`` is the pipeline engine's PipelineParallelGrid; the plain engine uses our mpu.
    """
    grid = getattr(engine, "grid", None)
    if grid is None:
        found = {"dp size": engine.dp_world_size}
        expected = {"dp size": groups.dp_size}
    else:
        found = {"stage": grid.get_stage_id(), "data-parallel rank": grid.get_data_parallel_id(),
                 "tensor rank": grid.get_slice_parallel_rank(), "data-parallel group": sorted(grid.dp_group),
                 "pipeline group": sorted(grid.pp_group), "tensor group": sorted(grid.slice_group)}
        expected = {"stage": groups.pp_rank, "data-parallel rank": groups.dp_rank, "tensor rank": groups.tp_rank,
                    "data-parallel group": sorted(groups.dp_ranks), "pipeline group": sorted(groups.pp_ranks),
                    "tensor group": sorted(groups.tp_ranks)}
    wrong = [f"{key}: DeepSpeed {found[key]}, ours {expected[key]}" for key in found if found[key] != expected[key]]
    if wrong:
        raise EngineSetupError(f"rank {groups.global_rank}: DeepSpeed's rank grid differs from the model-parallel "
                               f"groups ({'; '.join(wrong)})")


def check_engine_precision(engine, config: TrainConfig) -> None:
    """The engine must run the precision the flags and the ds_config agreed on (Megatron-DeepSpeed asserts it too)."""
    if engine.fp16_enabled() != config.precision.fp16 or engine.bfloat16_enabled() != config.precision.bf16:
        raise EngineSetupError(f"DeepSpeed runs fp16={engine.fp16_enabled()} bf16={engine.bfloat16_enabled()} but "
                               f"the configuration says fp16={config.precision.fp16} bf16={config.precision.bf16}")


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

    engine.clip_fp32_gradients = lambda: None  # the clip is part of guarded_step
    optimizer.overflow = False
    optimizer.step = guarded_step


def initialize_engine(config: TrainConfig, groups: ParallelGroups, model: torch.nn.Module,
                      torch_optimizer: torch.optim.Optimizer, lr_scheduler: AnnealingLR):
    """deepspeed.initialize on our model, optimizer, schedule and groups; checked against our grid."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    pipeline = isinstance(model, PipelineModule)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch_optimizer, lr_scheduler=lr_scheduler,
                                           mpu=None if pipeline else DeepSpeedMPU(groups),
                                           config=deepspeed_config(config))
    check_engine_grid(engine, groups)
    check_engine_precision(engine, config)
    if not (engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization()):
        guard_fp32_steps(engine, groups)
    if engine.bfloat16_enabled():
        accumulate_bf16_gradients_in_one_kernel(engine)
        if config.precision.gradient_accumulation_fusion:
            accumulate_linear_weight_gradients_in_their_gemms(engine)
        take_the_gradient_norm_in_few_kernels(engine)
        write_the_bf16_weights_in_the_adamw_step(engine)  # before the clip, which wraps the step it leaves
        clip_inside_the_fused_adamw_step(engine)
        skip_the_one_rank_gradient_reduction(engine)
    if pipeline and (getattr(engine, "using_bf16_optimizer", False) or not engine.zero_optimization()):
        model.reduce_sequence_parallel_gradients_once_per_step()
    if config.logging.log_num_zeros_in_grad:
        count_zeros_before_each_step(engine, groups)
    if config.parallel.sync_tp_duplicated_parameters and groups.tp_size > 1:
        synchronize_tp_duplicates_after_each_step(engine, groups)
    if pipeline and config.data.reset_attention_mask:
        engine.set_has_attention_mask(True)
    return engine


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
    engine._take_model_step = counted_step


def tp_duplicated_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters every TP rank holds whole (layer norms, row-parallel and output biases, position
    embeddings): not ``tensor_model_parallel``."""
    return [(name, param) for name, param in module.named_parameters()
            if not getattr(param, "tensor_model_parallel", False)]


def synchronize_tp_duplicates(module: torch.nn.Module, groups: ParallelGroups) -> tuple[float, str | None]:
    """Collective: make every TP rank's copy of each TP-duplicated parameter equal TP rank 0's, bit for
    bit, in the optimizer's fp32 master (ZeRO partitions or bf16 buffers, through DeepSpeed's
    safe_get/set_full_fp32_param) and in the model; return (largest |difference| found, its name)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

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
        param.data.copy_(reference.to(param.dtype))
    if max_across_ranks(worst) == 0.0:
        return 0.0, None
    return max(gather_objects((worst, worst_name)), key=lambda found: found[0])  # rare: name where it was


def synchronize_tp_duplicates_after_each_step(engine, groups: ParallelGroups) -> None:
    """--sync-tp-duplicated-parameters: after every optimizer step; ``engine.tp_drift`` holds what the
    last synchronization found (0.0 when the copies were already equal)."""
    take_step = engine._take_model_step

    def synchronized_step(*args, **kwargs):
        result = take_step(*args, **kwargs)
        engine.tp_drift = synchronize_tp_duplicates(engine.module, groups)
        return result

    engine.tp_drift = (0.0, None)
    engine._take_model_step = synchronized_step


def counts_once(name: str, groups: ParallelGroups) -> bool:
    """False for a parameter this rank holds as a second copy: the tied embedding of the pipeline's
    last stage (DeepSpeed's ``tied_modules``), which the first stage owns."""
    return groups.is_first_stage or not name.startswith("tied_modules.")


def parameter_counts(model: torch.nn.Module, distinct_for: ParallelGroups | None = None) -> tuple[int, int]:
    """(parameters, parameters without embeddings) held by this rank.

    With ``distinct_for``, only this rank's share of the whole model's distinct parameters: a
    TP-replicated parameter counts on TP rank 0 only and the pipeline's second tied copy not at all,
    so the sum over all ranks of one model replica is the model's size.
    """
    total, embeddings = 0, 0
    for name, param in model.named_parameters():
        if distinct_for is not None:
            split = bool(getattr(param, "tensor_model_parallel", False))
            if not (split or distinct_for.tp_rank == 0) or not counts_once(name, distinct_for):
                continue
        total += param.numel()
        if re.search(r"(word|position)_embeddings", name):
            embeddings += param.numel()
    return total, total - embeddings
