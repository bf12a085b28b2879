"""The model, optimizer and learning-rate schedule handed to DeepSpeed, and the parameter counts.

Which module DeepSpeed gets:

    PP > 1, ZeRO 0/1     GPTModelPipe (a PipelineModule): DeepSpeed's PipelineEngine, 1F1B schedule
    PP = 1, ZeRO 0/1     GPTModelPipe too, as Megatron-DeepSpeed always did: same checkpoint layout
                         (layer_XX-model_YY-model_states.pt) whatever the pipeline degree
    PP = 1, ZeRO 2       GPTModel, a plain module: DeepSpeed's PipelineEngine refuses ZeRO >= 2
    PP = 1, ZeRO 3       GPTModel built partitioned under DeepSpeed's zero.Init (zero3.py): no rank
                         ever holds the whole model

The pipeline module is built on DeepSpeed's ``PipeModelDataParallelTopology(num_pp, num_mp=TP,
num_dp)``, whose rank grid is ours (parallel_state.py); the engine checks that rank by rank.

Optimizer: ``--optimizer adam`` is Adam with decoupled weight decay (torch.optim.AdamW, fused on
CUDA): p <- p - lr * (m_hat / (sqrt(v_hat) + eps) + wd * p), with wd = 0 for biases and norm
weights; with --use-bnb-optimizer the same update by bitsandbytes' AdamW8bit (8-bit moments, 32-bit
for the word embedding); ``sgd`` is torch.optim.SGD with --sgd-momentum. DeepSpeed wraps it (ZeRO,
BF16_Optimizer, fp16 loss scaling) and clips gradients to the ds_config's gradient_clipping.

The learning rate follows AnnealingLR (lr_schedule.py), handed to ``deepspeed.initialize`` as the
engine's scheduler: the engine steps it after every *applied* optimizer step (an fp16 overflow
skips it), with the increment from the batch calculator (the current global batch, in samples) and
the consumed tokens from the trainer, and saves it in the checkpoint's ``lr_scheduler`` entry.
"""
import re
from collections.abc import Callable

import torch

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.layer_norm import LayerNorm, RMSNorm
from megatron.core.parallel_state import ParallelGroups
from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.training.config import OptimizerConfig, ScheduleConfig, TrainConfig
from megatron.training.dist_utils import print_rank_0
from megatron.training.engine import zero3
from megatron.training.lr_schedule import AnnealingLR


def uses_pipeline_engine(pipeline_model_parallel_size: int, zero_stage: int) -> bool:
    """GPTModelPipe on DeepSpeed's PipelineEngine unless ZeRO >= 2 (then PP is 1, validated at parse)."""
    return pipeline_model_parallel_size > 1 or zero_stage < 2


def current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def build_model(config: TrainConfig, groups: ParallelGroups) -> torch.nn.Module:
    """GPTModelPipe on DeepSpeed's topology of our grid, or GPTModel (see the module docstring)."""
    device = current_device() if torch.cuda.is_available() else None
    if config.parallel.zero_stage == 3:
        with zero3.partitioned_construction(config.deepspeed.config_for_initialize(), groups):
            model = GPTModel(config.model, groups, device=device)
        zero3.register_tied_embedding(model)
        zero3.gather_whole_layers(model)
        return model
    if not uses_pipeline_engine(groups.pp_size, config.parallel.zero_stage):
        return GPTModel(config.model, groups, device=device)
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from megatron.training.engine.pipeline_module import GPTModelPipe

    topology = PipeModelDataParallelTopology(num_pp=groups.pp_size, num_mp=groups.tp_size, num_dp=groups.dp_size)
    return GPTModelPipe(config.model, groups, topology, partition_method=config.parallel.pp_partition_method,
                        device=device)


def _is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, (LayerNorm, RMSNorm, torch.nn.LayerNorm))


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
        numel = zero3.full_numel(param)  # a ZeRO-3 parameter counts whole: the rank's share of the model
        total += numel
        if re.search(r"(word|position)_embeddings", name):
            embeddings += numel
    return total, total - embeddings
