"""How the trainer changes the steps of DeepSpeed's BF16_Optimizer (bf16 weights, fp32 master weights
and gradient accumulators, one flat fp32 partition per parameter group stepped by a torch optimizer).

Each function below replaces one method or attribute of an engine's optimizer after
``deepspeed.initialize`` (``deepspeed_engine.start_engine`` applies them; each is declared in
replacements.py), checks that the DeepSpeed it runs has what it replaces, and otherwise leaves
DeepSpeed's own code in charge:

    accumulate_in_one_kernel             hp += lp in one kernel, no fp32 copy of lp
    fuse_weight_gradient_accumulation    dW added into the accumulator by its GEMM
    norm_in_few_kernels                  ||g|| in one kernel per group, or a multi-tensor one
    adamw_writes_bf16_weights            AdamW and the bf16 copy of the weights in one pass
    clip_in_adamw                        the clip as the fused AdamW's grad_scale
    skip_single_rank_reduction           no bf16 round trip of the accumulators at DP = 1
"""
import torch

from megatron.core import fused_kernels
from megatron.core.parallel_state import group_size
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.training.engine.replacements import is_enabled


def accumulate_in_one_kernel(engine) -> None:
    """DeepSpeed's BF16_Optimizer adds each micro-batch's bf16 gradients into their fp32 accumulators
    as ``hp.add_(lp.to(float32))``, which writes an fp32 copy of every gradient and reads it back:
    at 1.3B parameters 8 GB of traffic per micro-batch. ``hp.add_(lp)`` converts element by element
    inside the add, and the sums are the same bit for bit (bf16 -> fp32 is exact). This replaces the
    optimizer's per-parameter update by that; DeepSpeed versions without that method, or with an
    expert-parallel gradient correction in it, keep their own."""
    if not is_enabled("bf16_steps.accumulate_in_one_kernel"):
        return
    optimizer = engine.optimizer
    if not hasattr(optimizer, "_update_hp_grad") or not hasattr(optimizer, "fp32_groups_gradients") \
            or getattr(optimizer, "autoep_folding_tp_group", None) is not None:
        return

    @torch.no_grad()
    def update_hp_grad(lp, group_idx, param_idx, clear_lp_grads):
        if lp.grad is None:
            return
        hp_grad = optimizer.fp32_groups_gradients[group_idx][param_idx]
        hp_grad.add_(lp.grad.view(hp_grad.shape))
        lp._hp_grad = hp_grad
        optimizer.fp32_groups_has_gradients[group_idx][param_idx] = True
        if clear_lp_grads:
            lp.grad.zero_()

    optimizer._update_hp_grad = update_hp_grad


def fuse_weight_gradient_accumulation(engine) -> int:
    """Gradient-accumulation fusion on DeepSpeed's BF16_Optimizer with fp32 accumulators: each weight of
    a ColumnParallelLinear or RowParallelLinear gets its fp32 accumulator as ``main_grad``, where its
    backward GEMM adds dW (``tensor_parallel.layers``): per micro-batch and weight of P values, no bf16
    dW (2P bytes written, then read with the accumulator and written back: 10P more) and no rounding
    of dW to bf16. Autograd then hands the optimizer no gradient for these weights, so they are marked
    as having one (the norm and clipping read only marked accumulators) again after every clear.
    Returns the number of weights fused (0 on other optimizers, which keep autograd's gradients)."""
    if not is_enabled("bf16_steps.fuse_weight_gradient_accumulation"):
        return 0
    optimizer = engine.optimizer
    accumulators = getattr(optimizer, "fp32_groups_gradients", None)
    if accumulators is None or not hasattr(optimizer, "fp32_groups_has_gradients") \
            or not hasattr(optimizer, "clear_hp_grads"):
        return 0
    linear_weights = {id(module.weight) for module in engine.module.modules()
                      if isinstance(module, (ColumnParallelLinear, RowParallelLinear))}
    fused = []
    for group_index, group in enumerate(optimizer.bf16_groups):
        for param_index, param in enumerate(group):
            accumulator = accumulators[group_index][param_index]
            if id(param) in linear_weights and accumulator.dtype == torch.float32:
                param.main_grad = accumulator.view(param.shape)
                param._hp_grad = accumulator  # where DeepSpeed's full-gradient readers look
                fused.append((group_index, param_index))
    clear = optimizer.clear_hp_grads

    def mark():
        for group_index, param_index in fused:
            optimizer.fp32_groups_has_gradients[group_index][param_index] = True

    def clear_and_mark():
        clear()
        mark()

    optimizer.clear_hp_grads = clear_and_mark
    mark()
    return len(fused)


def norm_in_few_kernels(engine) -> bool:
    """BF16_Optimizer takes ||g|| before each step as one norm kernel per parameter's fp32 accumulator,
    leaving out those this rank must not count (the pipeline's tied second copy; on TP ranks other
    than 0 the TP-replicated ones), then stacks them: at 1.3B parameters 292 reductions and their
    launches. Here the list it takes the norm of is shortened, ||g|| unchanged but for the order of
    the fp32 sums:

    - nothing left out (no tied copy on this stage, TP rank 0 or nothing replicated) and no experts:
      each group's flat accumulator (``fp32_groups_actual_gradients_flat``, padding cut off; a
      parameter without a gradient this step has a zero accumulator, cleared after every step, as it
      counts nothing in DeepSpeed's sum), one kernel per group;
    - else the vector of the listed accumulators' norms, taken by torch's multi-tensor
      ``_foreach_norm`` (a few launches): its norm is sqrt(sum of ||g_i||^2), the same ||g||.

    The clip's list (``for_clipping``) is DeepSpeed's. Returns whether this applies (a BF16_Optimizer
    without experts)."""
    if not is_enabled("bf16_steps.norm_in_few_kernels"):
        return False
    optimizer = engine.optimizer
    if not (hasattr(optimizer, "fp32_groups_actual_gradients_flat") and hasattr(optimizer, "get_grads_for_norm")
            and hasattr(optimizer, "bf16_groups") and getattr(optimizer, "has_moe_layers", True) is False):
        return False
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank

    tp_rank = bwc_tensor_model_parallel_rank(mpu=optimizer.mpu)
    leaves_some_out = any(getattr(param, "ds_pipe_replicated", False)
                          or not (tp_rank == 0 or is_model_parallel_parameter(param))
                          for group in optimizer.bf16_groups for param in group)
    listed_per_parameter = optimizer.get_grads_for_norm

    def get_grads_for_norm(for_clipping=False):
        if for_clipping:
            return listed_per_parameter(for_clipping=True)
        if not leaves_some_out:
            return list(optimizer.fp32_groups_actual_gradients_flat), {}
        listed, experts = listed_per_parameter()
        return ([torch.stack(torch._foreach_norm(listed))] if listed else listed), experts

    optimizer.get_grads_for_norm = get_grads_for_norm
    return True


def _fused_torch_adamw(optimizer) -> torch.optim.AdamW | None:
    """The torch optimizer ``optimizer`` (DeepSpeed's wrapper) steps, when it is a fused AdamW; else None."""
    torch_optimizer = getattr(optimizer, "optimizer", None)
    if isinstance(torch_optimizer, torch.optim.AdamW) and torch_optimizer.defaults.get("fused"):
        return torch_optimizer
    return None


def _fused_adamw_groups(optimizer) -> list | None:
    """(fp32 partition, bf16 partition) of each parameter group when ``optimizer`` is a BF16_Optimizer
    around a fused torch AdamW stepping exactly its fp32 partitions, with no option the fused kernel
    lacks (amsgrad, maximize, a tensor learning rate); else None."""
    torch_optimizer = _fused_torch_adamw(optimizer)
    needed = ("fp32_groups_flat_partition", "bf16_partitioned_groups", "real_dp_process_group", "bf16_groups_flat",
              "nccl_start_alignment_factor", "allgather_bucket_size", "update_lp_params")
    if torch_optimizer is None or not all(hasattr(optimizer, name) for name in needed):
        return None
    import deepspeed.comm as dist

    pairs = []
    for group, fp32_partition, bf16_partitions, dp_group in zip(
            torch_optimizer.param_groups, optimizer.fp32_groups_flat_partition, optimizer.bf16_partitioned_groups,
            optimizer.real_dp_process_group, strict=True):
        if group["amsgrad"] or group["maximize"] or isinstance(group["lr"], torch.Tensor) \
                or len(group["params"]) != 1 or group["params"][0] is not fp32_partition:
            return None
        pairs.append((fp32_partition, bf16_partitions[dist.get_rank(group=dp_group)]))
    return pairs


def adamw_writes_bf16_weights(engine) -> bool:
    """DeepSpeed's BF16_Optimizer steps the fused torch AdamW on its fp32 partitions, then copies each
    into the bf16 weights (``update_lp_params``, before its all-gather over data parallelism): per
    parameter torch's kernel reads p, g, m, v and writes p, m, v and (under a grad_scale) g, 32 bytes,
    and the copy moves 6 more. Here ``fused_kernels.adamw_step`` does the same update and writes the
    bf16 weight in the same pass (30 bytes), and ``update_lp_params`` right after that step only
    all-gathers. The moments and the step count stay in the torch AdamW's state, as torch keeps them,
    so checkpoints do not change; a grad_scale the clip sets (``clip_in_adamw``) is
    honoured. Applies to a BF16_Optimizer around a fused torch AdamW (``_fused_adamw_groups``) whose
    partitions are on CUDA with fused kernels enabled (``runs_fused_adamw``); returns whether it did."""
    if not is_enabled("bf16_steps.adamw_writes_bf16_weights"):
        return False
    optimizer = engine.optimizer
    pairs = _fused_adamw_groups(optimizer)
    if pairs is None or not all(runs_fused_adamw(fp32_partition) for fp32_partition, _ in pairs):
        return False
    from deepspeed.runtime.utils import all_gather_dp_groups

    torch_optimizer = optimizer.optimizer
    bf16_partition_of = {id(fp32_partition): bf16_partition for fp32_partition, bf16_partition in pairs}
    copy_update_lp_params = optimizer.update_lp_params
    bf16_written = []

    @torch.no_grad()
    def adamw_step(closure=None):
        if closure is not None:
            raise NotImplementedError("the fused AdamW step takes no closure")
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    _adamw_step_writing_bf16(torch_optimizer, group, param, bf16_partition_of[id(param)])
        bf16_written.append(True)

    def update_lp_params():
        if not bf16_written:  # fp32 weights changed elsewhere (a loaded checkpoint): DeepSpeed copies them
            return copy_update_lp_params()
        bf16_written.clear()
        all_gather_dp_groups(groups_flat=optimizer.bf16_groups_flat,
                             partitioned_param_groups=optimizer.bf16_partitioned_groups,
                             dp_process_group=optimizer.real_dp_process_group,
                             start_alignment_factor=optimizer.nccl_start_alignment_factor,
                             allgather_bucket_size=optimizer.allgather_bucket_size)

    torch_optimizer.step = adamw_step
    optimizer.update_lp_params = update_lp_params
    return True


def runs_fused_adamw(tensor: torch.Tensor) -> bool:
    """Whether ``fused_kernels.adamw_step`` runs its kernel on ``tensor`` (on CPU it would run the
    torch reference, slower than torch's fused CPU AdamW, so the trainer keeps torch's step there)."""
    return tensor.is_cuda and fused_kernels.fused_kernels_enabled()


def _adamw_step_writing_bf16(torch_optimizer, group: dict, param: torch.Tensor, bf16_param: torch.Tensor) -> None:
    """One AdamW step of ``param`` with the state torch's AdamW keeps (created as torch creates it for
    a fused step: a float32 step count on the device and zero moments), ``bf16_param`` <- the result."""
    state = torch_optimizer.state[param]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    state["step"] += 1
    beta1, beta2 = group["betas"]
    fused_kernels.adamw_step(param, param.grad, state["exp_avg"], state["exp_avg_sq"], state["step"],
                             lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                             weight_decay=group["weight_decay"], grad_scale=getattr(torch_optimizer, "grad_scale", None),
                             param_copy=bf16_param)


def clip_in_adamw(engine) -> bool:
    """DeepSpeed's BF16_Optimizer clips by multiplying every fp32 gradient accumulator by
    c = clip / (||g|| + 1e-6) when c < 1, tensor by tensor after reading the norm on the host (at
    1.3B parameters 10 GB of traffic and a host wait per step), then steps the torch optimizer it
    wraps. torch's fused AdamW divides each gradient by its ``grad_scale`` tensor inside the update
    kernel; with grad_scale = max(1, (||g|| + 1e-6) / clip), computed on the device from the norm
    the BF16_Optimizer has just taken, the clip costs nothing. The BF16_Optimizer's own clip is off
    only while it steps (its saved state keeps the configured value). Returns whether that applies:
    a BF16_Optimizer with clipping around a fused torch AdamW."""
    if not is_enabled("bf16_steps.clip_in_adamw"):
        return False
    optimizer = engine.optimizer
    torch_optimizer = _fused_torch_adamw(optimizer)
    max_norm = getattr(optimizer, "clip_grad", 0.0)
    if not (hasattr(optimizer, "fp32_groups_gradients") and max_norm > 0.0 and torch_optimizer is not None):
        return False
    bf16_step, adamw_step = optimizer.step, torch_optimizer.step

    def adamw_step_with_clip(*args, **kwargs):
        norm = torch.as_tensor(optimizer._global_grad_norm, dtype=torch.float32, device=engine.device)
        torch_optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)
        try:
            return adamw_step(*args, **kwargs)
        finally:
            del torch_optimizer.grad_scale

    def step_without_its_own_clip(*args, **kwargs):
        optimizer.clip_grad = 0.0
        try:
            return bf16_step(*args, **kwargs)
        finally:
            optimizer.clip_grad = max_norm

    torch_optimizer.step = adamw_step_with_clip
    optimizer.step = step_without_its_own_clip
    return True


def skip_single_rank_reduction(engine) -> bool:
    """DeepSpeed's pipeline engine (which also runs PP = 1 at ZeRO 0/1) reduces BF16_Optimizer's fp32
    gradient accumulators over data parallelism once per step by casting them to the communication
    dtype (bf16 unless the ds_config sets ``communication_data_type``), all-reducing and casting back.
    With one data-parallel rank nothing is summed and the pass only rounds the accumulated gradients
    to bf16: at 1.3B parameters 16 GB of traffic per step for a loss of precision. Here that pass is
    skipped when the data-parallel group has one rank. Applies to a pipeline engine on
    BF16_Optimizer; returns whether it did."""
    if not is_enabled("bf16_steps.skip_single_rank_reduction"):
        return False
    if not (getattr(engine, "using_bf16_optimizer", False) and hasattr(engine, "_bf16_reduce_grads")):
        return False
    if group_size(engine.mpu.get_data_parallel_group()) > 1:
        return False
    engine._bf16_reduce_grads = lambda: None
    return True
