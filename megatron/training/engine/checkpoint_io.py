"""Checkpoint files through DeepSpeed's engine: what its save writes and its load reads, made visible
to the trainer (declared replacements of its checkpoint engine's ``save`` and ``load``), and the
engine-side fix-ups around a load.

``engine.save_checkpoint(directory, tag=..., client_state=..., save_latest=False)`` writes the module
(one ``layer_XX-model_TT-model_states.pt`` per pipeline layer, or the whole module for the plain
engine), the optimizer partitions and ``mp_rank_MM_model_states.pt``, never ``latest``: the trainer
commits that itself once every rank is done (checkpointing.py).
"""
import contextlib
import functools
import os
from collections.abc import Callable

import deepspeed
import torch

from megatron.core.checkpoint.names import pipeline_name
from megatron.core.checkpoint.output import naming_refused_writes
from megatron.core.checkpoint.universal import tp_share_of_universal
from megatron.training.engine.interface import ReadFilter
from megatron.training.engine.replacements import replaced_for_block

RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def deepspeed_version() -> str:
    """The installed DeepSpeed's version, as DeepSpeed writes it into its checkpoints (``ds_version``)."""
    return deepspeed.__version__


@contextlib.contextmanager
def recorded_writes(engine, file_written: Callable[[str], None]):
    """Inside the block, every file DeepSpeed's checkpoint engine writes goes through a Python file
    (torch's writer, given a path, reports a refused write as a bare RuntimeError; an OSError here
    names the file), then ``file_written(path)``."""
    writer = engine.checkpoint_engine
    original_save = writer.save

    def save(state_dict, path):
        with naming_refused_writes(path), open(path, "wb") as f:
            result = original_save(state_dict, f)
        file_written(path)
        return result

    with replaced_for_block("checkpoint_io.recorded_writes", writer, "save", save):
        yield


@contextlib.contextmanager
def filtered_reads(engine, filters: list[ReadFilter]):
    """Inside the block, every file DeepSpeed's checkpoint engine reads goes through ``filters``, the
    first outermost: ``filter(path, read)`` may check the file, call ``read()`` (the next filter, and
    last DeepSpeed's own read) and change what it returns."""
    reader = engine.checkpoint_engine
    original_load = reader.load

    def load(path, map_location=None):
        read = functools.partial(original_load, path, map_location=map_location)
        for read_filter in reversed(filters):
            read = functools.partial(read_filter, path, read)
        return read()

    with replaced_for_block("checkpoint_io.filtered_reads", reader, "load", load):
        yield


@contextlib.contextmanager
def universal_parameter_names(engine, num_layers: int, active: bool):
    """Inside the block (when ``active``: a universal load on the plain engine), the ZeRO optimizer
    names its parameters as the pipeline module does, the names of a universal checkpoint's folders
    (megatron.core.checkpoint.names); its own names come back after, so its next save keeps them."""
    optimizer = engine.optimizer
    if not active or not hasattr(optimizer, "param_names"):
        yield
        return
    renamed = {param: pipeline_name(name, num_layers) for param, name in optimizer.param_names.items()}
    with replaced_for_block("checkpoint_io.universal_parameter_names", optimizer, "param_names", renamed):
        yield


def steps_beside_moments(engine) -> None:
    """DeepSpeed's universal load sets Adam's step to the tensor read from step.pt, on the CPU; torch's
    fused AdamW (on the GPU) needs it on the moments' device, in fp32, as its own load_state_dict puts it."""
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in base.state.values():
        step, moment = state.get("step"), state.get("exp_avg")
        if torch.is_tensor(step) and torch.is_tensor(moment) and step.device != moment.device:
            state["step"] = step.to(device=moment.device, dtype=torch.float32)


def optimizer_parameter_names(engine) -> list[list[str]]:
    """The names of the optimizer's parameters, group by group in its order: at ZeRO stage 0 the saved
    optimizer state numbers them by that order only, and the universal conversion needs the names."""
    names = {id(parameter): name for name, parameter in engine.module.named_parameters()}
    return [[names[id(parameter)] for parameter in group["params"]] for group in engine.optimizer.param_groups]


def remove_recovery_scripts(directory: str) -> None:
    """DeepSpeed copies its zero_to_fp32.py / zero_to_torch.py next to every ZeRO checkpoint, but they
    cannot read the pipeline engine's checkpoints (its mp_rank files hold no module): drop them there
    rather than leave a tool that fails. They stay with the plain engine's (ZeRO-2) checkpoints."""
    for name in RECOVERY_SCRIPTS:
        path = os.path.join(directory, name)
        if os.path.exists(path):
            os.remove(path)


def _model_states_name(engine):
    """DeepSpeed's ``_get_ckpt_name`` below ZeRO-3: ``mp_rank_MM_model_states.pt``, one per model-parallel rank."""
    def name(checkpoints_path, tag, mp_placeholder=None, pp_placeholder=None):
        mp_rank = mp_placeholder if mp_placeholder is not None else f"{engine.checkpoint_mp_rank:02d}"
        return os.path.join(checkpoints_path, str(tag), f"mp_rank_{mp_rank}_model_states.pt")
    return name


def _require(changed: bool) -> None:
    if not changed:
        raise RuntimeError("ZeRO-3 checkpoints need the engine's replacements of DeepSpeed's checkpoint methods, "
                           "which are off on this DeepSpeed (--allow-untested-deepspeed): they would not have the "
                           "trainer's layout")


@contextlib.contextmanager
def zero3_model_states(engine, data_parallel_rank: int):
    """Inside the block DeepSpeed's ZeRO-3 save writes the plain engine's layout: DP rank 0 of each
    model-parallel rank writes ``mp_rank_MM_model_states.pt`` with the WHOLE module (gathered module by
    module, zero3.gathered_state_dict: the merge, reshape and export tools read it as a ZeRO-2
    checkpoint's), instead of every rank writing ``zero_pp_rank_D_mp_rank_MM_model_states.pt`` with
    empty placeholders; the optimizer partitions are DeepSpeed's. Its load reads that file."""
    from megatron.training.engine import zero3

    module = zero3.gathered_state_dict(engine.module, keep=data_parallel_rank == 0)
    with replaced_for_block("checkpoint_io.zero3_model_states", engine, "_get_ckpt_name",
                            _model_states_name(engine)) as named, \
            replaced_for_block("checkpoint_io.zero3_gathered_module", engine, "module_state_dict",
                               lambda *args, **kwargs: module) as whole, \
            replaced_for_block("checkpoint_io.zero3_one_writer", engine, "save_non_zero_checkpoint",
                               data_parallel_rank == 0) as one_writer:
        _require(named and whole and one_writer)
        yield


@contextlib.contextmanager
def zero3_module_reads(engine, load_optimizer: bool):
    """Inside the block DeepSpeed's ZeRO-3 load reads ``mp_rank_MM_model_states.pt`` (zero3_model_states)
    and copies its whole module into the partitioned parameters (pass ``load_zero3_module`` as the
    load's ``custom_load_fn``). Without the optimizer DeepSpeed would rebuild the module from the
    optimizer partitions with zero_to_fp32 (which mixes the TP ranks' files): it reads the module
    file instead, as at ZeRO 1 and 2, the fp32 master then copied from the weights."""
    with replaced_for_block("checkpoint_io.zero3_model_states", engine, "_get_ckpt_name",
                            _model_states_name(engine)) as named:
        _require(named)
        if load_optimizer:
            yield
            return
        with replaced_for_block("checkpoint_io.zero3_module_reads", engine, "zero_optimization_partition_weights",
                                lambda: False) as module_file:
            _require(module_file)
            yield


def load_zero3_module(src: dict, dst: torch.nn.Module) -> None:
    """DeepSpeed's ``custom_load_fn`` at ZeRO-3: the module file's whole tensors into the partitioned model."""
    from megatron.training.engine import zero3

    zero3.load_gathered_state_dict(dst, src)


@contextlib.contextmanager
def zero3_universal_reads(engine, tp_rank: int, tp_size: int, directory: str):
    """Inside the block DeepSpeed's ZeRO-3 universal load cuts each parameter's full tensors for this
    rank: the TP slice (``tp_share_of_universal``, as its ZeRO 1/2 load does; its ZeRO-3 load would
    partition the whole tensor over DP), then the DP share of that slice. After it, each parameter
    group gets back its own saved settings (``directory``/zero/optimizer_state.pt): DeepSpeed's
    ZeRO-3 load gives every group the first group's, weight decay included; and each flat group its
    own step counter (that load gives them all one tensor, which torch's Adam then advances once per
    group in every step)."""
    from deepspeed import comm

    optimizer = engine.optimizer

    def load_hp_checkpoint_state(folder, key, param=None):
        entry = torch.load(os.path.join(folder, f"{key}.pt"), map_location="cpu", weights_only=False)
        vocab_rows = param.ds_shape[0] * tp_size if entry.get("vocab_tensor") else None
        tp_slice = tp_share_of_universal(entry, tp_rank, tp_size, vocab_rows).reshape(-1)
        group = param.ds_process_group
        dp_rank, dp_size = comm.get_rank(group=group), comm.get_world_size(group=group)
        share = -(-tp_slice.numel() // dp_size)
        padded = torch.nn.functional.pad(tp_slice, (0, share * dp_size - tp_slice.numel()))
        return padded.narrow(0, dp_rank * share, share)

    with replaced_for_block("checkpoint_io.zero3_universal_reads", optimizer, "load_hp_checkpoint_state",
                            load_hp_checkpoint_state) as changed:
        _require(changed)
        yield
    saved = torch.load(os.path.join(directory, "zero", "optimizer_state.pt"), map_location="cpu",
                       weights_only=False)["param_groups"]
    if len(saved) != len(optimizer.optimizer.param_groups):
        raise RuntimeError(f"{directory}: {len(saved)} saved parameter groups, the optimizer has "
                           f"{len(optimizer.optimizer.param_groups)}")
    for group, settings in zip(optimizer.optimizer.param_groups, saved):
        group.update({key: value for key, value in settings.items() if key != "params"})
    for state in optimizer.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
