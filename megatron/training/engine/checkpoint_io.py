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
