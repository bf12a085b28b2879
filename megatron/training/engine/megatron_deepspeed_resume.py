"""Resuming a checkpoint of Megatron-DeepSpeed (BigScience's fork) on this trainer's engine.

The format knowledge is in megatron.core.checkpoint.megatron_deepspeed; this module applies it to a
DeepSpeed engine whose layout (TP, PP, DP) is the checkpoint's:

  - ``translating_filter``: while DeepSpeed loads, its model-states files are read through the
    allow-list unpickler and translated into this trainer's state (so DeepSpeed restores the LR
    schedule and step counters and returns our counters as the client state; at ZeRO stage 0 the
    torch optimizer state they hold has its groups merged into ours), and its layer files' keys are
    renamed to ours;
  - ``restore_optimizer_states``: DeepSpeed cannot load the ZeRO partitions itself (Megatron-DeepSpeed's
    optimizer has three parameter groups, ours two, so the flat partitions differ); each parameter's
    fp32 weights and Adam moments are taken from the partitions by name and written into this rank's
    fragment of the optimizer, the way DeepSpeed's universal-checkpoint loading does (the embedding
    LayerNorm, which Megatron-DeepSpeed builds on the first stage only, has no state on the last);
  - ``own_rng_states``: Megatron-DeepSpeed's tracker holds one CUDA generator state per stream,
    ours a CPU and a CUDA state: the CUDA part is restored (on a GPU), the CPU part stays as seeded.
"""
import os

import torch

from megatron.core.checkpoint import megatron_deepspeed
from megatron.core.checkpoint.layer_files import LAYER_FILE
from megatron.core.tensor_parallel import get_rng_tracker
from megatron.training.checkpoint_checks import CheckpointError


def translating_filter(load_optimizer: bool):
    """A read filter (interface.ReadFilter) for the engine's load: model-states files translated as
    the module docstring says (the stage-0 optimizer state's when ``load_optimizer``), layer files'
    keys renamed, other reads unchanged. A state that cannot be translated raises a CheckpointError."""

    def read(path: str, engine_read):
        name = os.path.basename(path)
        if megatron_deepspeed.MODEL_STATES_FILE.match(name):
            state = megatron_deepspeed.trainer_state(megatron_deepspeed.load_file(path, mmap=False))
            if not load_optimizer:
                return state
            try:
                return {**state, "optimizer": megatron_deepspeed.own_optimizer_state(state.get("optimizer"), path)}
            except megatron_deepspeed.MegatronDeepSpeedError as error:
                raise CheckpointError(str(error)) from error
        loaded = engine_read()
        return megatron_deepspeed.own_layer_state(loaded) if LAYER_FILE.match(name) else loaded

    return read


def restore_optimizer_states(engine, tag_directory: str) -> None:
    """This rank's fragments of the fp32 weights, the Adam moments and step, from the checkpoint's
    ZeRO partitions of its model-parallel rank (module docstring); a CheckpointError names what
    prevents it."""
    try:
        _restore_optimizer_states(engine, tag_directory)
    except megatron_deepspeed.MegatronDeepSpeedError as error:
        raise CheckpointError(str(error)) from error


def _restore_optimizer_states(engine, tag_directory: str) -> None:
    optimizer = engine.optimizer
    lp_groups = getattr(optimizer, "bf16_groups", None) or getattr(optimizer, "bit16_groups", None)
    if lp_groups is None:
        raise megatron_deepspeed.MegatronDeepSpeedError(
            f"{tag_directory}: its optimizer states are ZeRO partitions and this run's optimizer is not partitioned "
            f"(ZeRO stage 0): resume with --zero-stage 1, as it was saved, or with --no-load-optim")
    states, step = megatron_deepspeed.parameter_states(tag_directory, engine.checkpoint_mp_rank)
    base = optimizer.optimizer
    for group, lp_params in zip(base.param_groups, lp_groups):
        flat = group["params"][0]
        moments = {key: torch.zeros_like(flat) for key in megatron_deepspeed.ADAM_STATES}
        for lp in lp_params:
            mapping = lp._hp_mapping
            if mapping is None:
                continue
            saved = _saved_parameter(states, optimizer.param_names[lp], tag_directory)
            if saved is None:
                continue
            lp_address, hp_address = mapping.lp_fragment_address, mapping.hp_fragment_address
            mapping.hp_fragment.data.copy_(saved["fp32"].flatten().narrow(0, lp_address.start, lp_address.numel))
            for key, moment in moments.items():
                fragment = saved[key].flatten().narrow(0, lp_address.start, lp_address.numel)
                moment.narrow(0, hp_address.start, hp_address.numel).copy_(fragment)
        base.state[flat] = {"step": _step_tensor(step, flat), **moments}
    optimizer._hp_optimizer_states_linked = False  # DeepSpeed re-links each parameter to the new moments
    optimizer._lazy_init_hp_params_optimizer_state()


def _saved_parameter(states: dict, name: str, tag_directory: str) -> dict | None:
    """The saved states of parameter ``name``; None for the embedding LayerNorm's copy on the last pipeline
    stage, which Megatron-DeepSpeed does not build (it keeps the weights read from layer_01, no moments)."""
    if name not in states and name.startswith(megatron_deepspeed.TIED_EMBEDDING_LAYERNORM):
        return None
    if name not in states:
        raise megatron_deepspeed.MegatronDeepSpeedError(
            f"{tag_directory}: the optimizer partitions hold no state for {name} (they name "
            f"{', '.join(sorted(states)[:4])}, ...): the checkpoint is of another model; resume with --no-load-optim")
    return states[name]


def _step_tensor(step, flat: torch.Tensor) -> torch.Tensor:
    """Adam's step as torch's Adam keeps it: a float32 scalar tensor (apex's FusedAdam saved an int)."""
    value = step.item() if torch.is_tensor(step) else float(step or 0)
    return torch.tensor(float(value), dtype=torch.float32, device=flat.device if flat.is_cuda else "cpu")


def own_rng_states(state: dict) -> dict:
    """``state``'s RNG entries with Megatron-DeepSpeed's tracker states made ours (module docstring)."""
    current = get_rng_tracker().get_states()
    saved = state.get("rng_tracker_states") or {}
    tracker = {}
    for name, streams in current.items():
        cuda = saved.get(name) if torch.cuda.is_available() else None
        tracker[name] = type(streams)(streams.cpu, cuda if cuda is not None else streams.cuda)
    return {**state, "rng_tracker_states": tracker}
