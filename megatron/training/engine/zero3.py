"""ZeRO stage 3 at PP = 1: the model built partitioned, and what reads its partitioned parameters.

Under ZeRO-3 every parameter P of a data-parallel group of size d lives as d flat slices, rank r
holding elements [r * ceil(n / d), (r + 1) * ceil(n / d)) of P flattened (DeepSpeed's ``ds_tensor``;
``param.data`` is empty between uses, ``param.ds_shape`` / ``ds_numel`` give the full shape). A
tensor-parallel slice is partitioned the same way over its own data-parallel group: TP and ZeRO-3
compose, each rank holding 1 / (TP * d) of a split weight.

``partitioned_construction`` builds the model under DeepSpeed's ``zero.Init`` so that no rank ever
holds the whole model, with three differences from DeepSpeed's defaults, each for identical weights
to ZeRO 0-2's for the same seed:

    - a module's own parameters are partitioned when its PARENT's constructor returns, not its own:
      a parent may still initialise its children's weights (the learned position table is drawn
      by the embedding that holds it); at most one module's children are whole at a time;
    - no tensor-creation overrides: the model already creates each parameter on its device in its
      dtype, and the fp32 master weights of CPU initialisation must stay fp32 on the CPU;
    - ``torch.nn.functional.linear`` stays torch's (``zero_optimization.memory_efficient_linear``
      is false unless the ds_config sets it, ds_config.py): the TP layers run their own autograd
      functions and the rest of the process keeps torch's linear.

Releasing a gathered parameter replaces its data; a tensor that autograd saved as a view of that data
(torch's linear saves W^T for dX = dY W) would keep it alive until backward, and with it every layer's
gathered weights at the end of the forward: 11.7 of the 23.3 GiB peak of the 6.7B GPT under CPU offload
on one GPU. The parallel linear layers therefore save the parameter itself (``released_after_use``,
megatron/core/tensor_parallel/layers.py), which DeepSpeed gathers again before the layer's backward.

The tied output head reads the word embeddings outside their module's forward: the table is
registered as an external parameter of the model, so DeepSpeed gathers it for the whole forward
and backward.

``share_offloaded_gradient_partitions`` drops one of the two fp32 gradient partitions DeepSpeed keeps in
host memory under optimizer offload (4 of its 22 bytes per parameter), where they are not pinned.

``gather_whole_layers`` makes each transformer layer one of DeepSpeed's leaf modules: its parameters
are gathered and released together, and DeepSpeed hooks the layer instead of each of its norms,
projections and attention modules. Each hook costs the host tens of microseconds (DeepSpeed's
fetch and release bookkeeping, an autograd function per module that binds its arguments through
``inspect.signature``), which at the module level took longer than the GPU's work: ZeRO-3's
1.3B iteration at DP = 2 left the GPU idle 40 % of the time. Whole layers cut the host's extra
time per micro-batch from 164 to 63 ms on the 24-layer model of ``tools/benchmarks/bench_zero3_host.sh``;
the price is one layer's full parameters live at a time instead of one module's.
"""
import contextlib

import deepspeed
import torch

from megatron.core.checkpoint.sharding import is_fp8_state
from megatron.core.models.gpt.transformer_layer import ParallelTransformerLayer
from megatron.core.parallel_state import ParallelGroups
from megatron.training.engine.mpu import DeepSpeedMPU
from megatron.training.engine.replacements import is_enabled


class _PartitionAfterParent(deepspeed.zero.Init):
    """zero.Init that partitions a module's own parameters once its parent is constructed (module docstring)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._waiting = []  # constructed modules whose parent is still being constructed

    def _post_init_method(self, module):
        descendants = {id(child) for child in module.modules() if child is not module}
        ready = [child for child in self._waiting if id(child) in descendants]
        self._waiting = [child for child in self._waiting if id(child) not in descendants]
        for child in ready:
            super()._post_init_method(child)
        self._waiting.append(module)

    def __exit__(self, exc_type, exc_value, traceback):
        waiting, self._waiting = self._waiting, []
        if exc_type is None:
            for module in waiting:
                super()._post_init_method(module)
        return super().__exit__(exc_type, exc_value, traceback)


@contextlib.contextmanager
def partitioned_construction(ds_config: dict, groups: ParallelGroups):
    """Modules constructed inside are partitioned over ``groups``' data-parallel group (module docstring)."""
    with _PartitionAfterParent(data_parallel_group=groups.process_groups["dp"], config_dict_or_path=ds_config,
                               mpu=DeepSpeedMPU(groups), tensor_overrides=[]):
        yield


def register_tied_embedding(model: torch.nn.Module) -> None:
    """The word-embedding table, read by the tied output head, gathered for the model's whole forward."""
    embedding = getattr(model, "embedding", None)
    if embedding is not None and getattr(model, "output_layer", None) is None:
        deepspeed.zero.register_external_parameter(model, embedding.word_embeddings.weight)


def gather_whole_layers(model: torch.nn.Module) -> None:
    """Each transformer layer gathered and released as one unit (DeepSpeed's leaf modules), every
    parameter marked ``released_after_use`` for the parallel linear layers (module docstring)."""
    deepspeed.utils.set_z3_leaf_modules(model, [ParallelTransformerLayer])
    for param in model.parameters():
        param.released_after_use = True


def gradient_views(partition_sizes: list[list[int]], positions: list[list[tuple[int, int]]],
                   group_sizes: list[int]) -> list[tuple[int, int]] | None:
    """Where each sub-group's fp32 gradient lies in the flat accumulation buffer: (start, length) per
    sub-group i, or None when some parameter's two places differ. ``partition_sizes[i]`` are the
    partition sizes n_p of sub-group i's parameters in order (the buffer holds every parameter's slice
    back to back in that order: parameter p at o_p); ``positions[i]`` their (sub-group, offset d_p) in
    the fp32 gradients (DeepSpeed's ``grad_position``); ``group_sizes[i]`` the fp32 partition's length.
    They line up when every p of sub-group i has o_p = o_first(i) + d_p and the lengths agree."""
    views, offset = [], 0
    for group, (sizes, places, length) in enumerate(zip(partition_sizes, positions, group_sizes)):
        start = offset
        for size, (owner, destination) in zip(sizes, places):
            if owner != group or offset != start + destination:
                return None
            offset += size
        if offset - start != length:
            return None
        views.append((start, length))
    return views


def share_offloaded_gradient_partitions(engine) -> float:
    """ZeRO-3 with the optimizer offloaded to the CPU: each sub-group's fp32 gradient (what its CPU Adam
    reads) made a view of the flat buffer in which DeepSpeed accumulates the reduced gradients; returns the
    bytes of host memory freed (0 when it does not apply or the two layouts differ).

    DeepSpeed keeps both in host memory, 4 bytes per parameter each, and at each accumulation boundary
    copies every parameter's slice of the buffer into its place in the fp32 gradient; once the places
    coincide (``gradient_views``) that copy writes each slice onto itself, and the separate fp32
    gradients (27 GB for a 6.7B GPT) are freed. The next window's first micro-batch overwrites the
    buffer, after the step has read it. Pinned gradients (DeepSpeed's default, ``offload_optimizer.
    pin_memory``) are left alone: PyTorch keeps freed pinned memory cached in the process, so sharing
    them would free nothing (a 2.7B GPT's pinned host memory stayed at 43.8 GB)."""
    optimizer = engine.optimizer
    if not (is_enabled("zero3.share_offloaded_gradient_partitions") and engine.zero_optimization_stage() == 3
            and getattr(optimizer, "offload_optimizer", False) and not getattr(optimizer, "swap_optimizer", True)):
        return 0.0
    flat = getattr(optimizer, "grad_partitions_flat_buffer", None)
    fp32_groups = optimizer.fp32_partitioned_groups_flat
    gradients = [group.grad for group in fp32_groups]
    if flat is None or any(g is None or g.dtype != flat.dtype or g.device != flat.device or g.is_pinned()
                           for g in gradients):
        return 0.0
    views = gradient_views([[p.partition_numel() for p in group] for group in optimizer.fp16_groups],
                           [[tuple(optimizer.grad_position[optimizer.get_param_id(p)][:2]) for p in group]
                            for group in optimizer.fp16_groups],
                           [group.numel() for group in fp32_groups])
    if views is None:
        return 0.0
    freed = 0.0
    for group, gradient, (start, length) in zip(fp32_groups, gradients, views):
        if gradient.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
            freed += gradient.untyped_storage().nbytes()
        group.grad = flat.narrow(0, start, length)
    return freed


def is_partitioned(param: torch.Tensor) -> bool:
    """A ZeRO-3 parameter (its data lives in DeepSpeed's partitions)."""
    return hasattr(param, "ds_id")


def full_numel(param: torch.Tensor) -> int:
    """The number of elements of ``param`` whole, partitioned or not."""
    return param.ds_numel if is_partitioned(param) else param.numel()


def gathered_state_dict(module: torch.nn.Module, keep: bool) -> dict:
    """Collective over the data-parallel group: ``module.state_dict()`` with every parameter whole,
    copied to the CPU, gathered one module at a time (so at most one module's parameters are whole
    at once); on a rank where ``keep`` is false the copies are not made and {} is returned."""
    from deepspeed.runtime.zero import GatheredParameters

    state = {}
    for prefix, submodule in module.named_modules():
        with GatheredParameters(list(submodule.parameters(recurse=False))):
            if keep:
                own = {}
                submodule._save_to_state_dict(own, f"{prefix}." if prefix else "", keep_vars=False)
                state.update((name, value.detach().cpu().clone()) for name, value in own.items())
    return state


def load_gathered_state_dict(module: torch.nn.Module, state: dict) -> None:
    """Collective over the data-parallel group: ``module.load_state_dict(state)`` (strict) for a state
    of whole tensors, loaded one module at a time into its gathered parameters (each module's own
    load hooks run: the FP8 layers' take or leave their scaling state) and partitioned again."""
    from deepspeed.runtime.zero import GatheredParameters

    expected = {key for key in module.state_dict() if not is_fp8_state(key)}
    weights = {key for key in state if not is_fp8_state(key)}
    if weights != expected:
        missing, unexpected = sorted(expected - weights), sorted(weights - expected)
        raise RuntimeError(f"the checkpoint's module does not match the model: missing {missing}, "
                           f"unexpected {unexpected}")
    state, errors = dict(state), []
    for prefix, submodule in module.named_modules():
        prefix = f"{prefix}." if prefix else ""
        with GatheredParameters(list(submodule.parameters(recurse=False)), modifier_rank=0), torch.no_grad():
            submodule._load_from_state_dict(state, prefix, {}, True, [], [], errors)
    if errors:
        raise RuntimeError("the checkpoint's module does not load: " + "; ".join(errors))
