"""A plain single-process PyTorch training loop: what every parallel layout of pretrain_gpt.py must reproduce.

No DeepSpeed, no process group, nothing from megatron.training: our GPTModel on single_rank_groups()
(the whole model in one process; with ``use_cpu_initialization`` its weights are the ones every TP/PP
layout builds), torch.optim.AdamW, torch's gradient clipping and the learning rate written out here.

Iteration k = 1, 2, ... trains on a global batch of B_k samples (B_k constant, or ramped up as
--rampup-batch-size does): training samples [c_{k-1}, c_k) with c_k = B_1 + ... + B_k, the samples
MegatronPretrainingSampler hands out, micro batch by micro batch, to the data-parallel ranks.

    lr_k   = schedule(c_{k-1})                 the samples consumed before the step (AnnealingLR's "steps")
    loss_k = mean cross entropy over the B_k·s tokens of the batch (the mean of the micro-batch means
             when every micro batch holds as many tokens, i.e. without --eod-mask-loss)
    n_k    = ||∇ loss_k||_2 before clipping;  ∇ ← ∇ · min(1, c / (n_k + 1e-6))
    z_k    = the number of zeros of ∇ loss_k (every parameter once, the tied embedding once)
    AdamW(lr_k, betas, eps), weight decay wd on the weights, 0 on biases and LayerNorm parameters

with W warmup samples, D decay samples, r = (n - W) / (D - W):

    schedule(n) = lr_max · n / W                                 if W > 0 and n <= W
                = lr_min                                         if n > D
                = lr_min + (1 - r) (lr_max - lr_min)             linear
                = lr_min + (1 + cos(pi r)) / 2 (lr_max - lr_min) cosine
"""
import math
from dataclasses import dataclass

import numpy as np
import torch

from megatron.core.data.gpt_dataset import GPTDataset
from megatron.core.data.indexed_dataset import make_dataset
from megatron.core.models.gpt import GPTModel, GPTModelConfig
from megatron.core.parallel_state import single_rank_groups


@dataclass(frozen=True)
class ReferenceSchedule:
    """Optimizer and schedule of the loop (module docstring), in the trainer's flag vocabulary;
    ``batch_sizes`` holds the global batch B_k of every iteration."""

    batch_sizes: tuple[int, ...]
    lr: float
    min_lr: float
    warmup_samples: int
    decay_samples: int
    decay_style: str
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float


@dataclass(frozen=True)
class ReferenceStep:
    """One iteration: the batch loss, the gradient norm before clipping and its zeros, the rate used and
    the next one."""

    loss: float
    grad_norm: float
    learning_rate: float
    next_learning_rate: float
    num_zeros: int


def learning_rate(consumed_samples: int, schedule: ReferenceSchedule) -> float:
    """schedule(n) of the module docstring."""
    n, warmup, decay = consumed_samples, schedule.warmup_samples, schedule.decay_samples
    if warmup > 0 and n <= warmup:
        return schedule.lr * n / warmup
    if n > decay:
        return schedule.min_lr
    ratio = (n - warmup) / (decay - warmup)
    if schedule.decay_style == "linear":
        coefficient = 1.0 - ratio
    elif schedule.decay_style == "cosine":
        coefficient = 0.5 * (1.0 + math.cos(math.pi * ratio))
    else:
        raise ValueError(f"the reference loop knows linear and cosine decay, not {schedule.decay_style!r}")
    return schedule.min_lr + coefficient * (schedule.lr - schedule.min_lr)


def without_weight_decay(name: str) -> bool:
    """Biases and LayerNorm parameters (GPTModel's ``*layernorm.weight`` / ``*.bias``) are not decayed."""
    return name.endswith(".bias") or "layernorm" in name


def build_adamw(model: torch.nn.Module, schedule: ReferenceSchedule) -> torch.optim.AdamW:
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if not without_weight_decay(n)], "weight_decay": schedule.weight_decay},
              {"params": [p for n, p in named if without_weight_decay(n)], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=schedule.lr, betas=(schedule.adam_beta1, schedule.adam_beta2),
                             eps=schedule.adam_eps)


def training_dataset(data_prefix: str, seq_length: int, seed: int, num_samples: int, cache_dir: str) -> GPTDataset:
    """The training GPTDataset of ``--data-path data_prefix --split 100,0,0``: every document, ``num_samples``
    samples (--train-samples, or --train-iters × global batch), the trainer's seed, hence its shuffle
    and its index caches."""
    indexed = make_dataset(data_prefix, "mmap")
    return GPTDataset("train", data_prefix, indexed, np.arange(len(indexed), dtype=np.int64), num_samples,
                      seq_length, seed, cache_dir=cache_dir)


def global_batch(dataset, start: int, size: int) -> torch.Tensor:
    """Samples [start, start + size) stacked: int64 [size, s + 1]."""
    rows = [dataset[index]["text"] for index in range(start, start + size)]
    return torch.from_numpy(np.stack(rows))


def run_reference_loop(model_config: GPTModelConfig, dataset, schedule: ReferenceSchedule) -> list[ReferenceStep]:
    """Train GPTModel(model_config) on len(schedule.batch_sizes) global batches (module docstring)."""
    torch.manual_seed(model_config.seed)
    model = GPTModel(model_config, single_rank_groups())
    model.train()
    optimizer = build_adamw(model, schedule)
    steps, consumed = [], 0
    for batch_size in schedule.batch_sizes:
        rate = learning_rate(consumed, schedule)
        for group in optimizer.param_groups:
            group["lr"] = rate
        text = global_batch(dataset, consumed, batch_size)  # [B_k, s + 1]
        consumed += batch_size
        tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()  # [B_k, s] each
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens, labels=labels)
        loss.backward()
        num_zeros = sum(int((param.grad == 0).sum()) for param in model.parameters())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), schedule.clip_grad)
        optimizer.step()
        steps.append(ReferenceStep(loss.item(), grad_norm.item(), rate, learning_rate(consumed, schedule), num_zeros))
    return steps
