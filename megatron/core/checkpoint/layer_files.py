"""The per-layer weight files of a checkpoint directory (``layer_XX-model_TT-model_states.pt``: layer
XX of the pipeline module's layer list, on tensor-parallel rank TT; docs/checkpoint-format.md), found,
checked for completeness and read back one layer at a time as full, unpartitioned tensors; and
written at another TP size.

Whatever the pipeline split, the files are named by the global layer index, so a checkpoint holds
every layer once per TP rank: the TP size is the number of ranks found, and every layer must have
the same ranks 0 .. k - 1.
"""
import os
import re
import tempfile
from dataclasses import dataclass

import torch

from megatron.core.checkpoint.names import ParameterNameError
from megatron.core.checkpoint.output import save_torch_file
from megatron.core.checkpoint.partitions import merge_partitions, split_partitions
from megatron.core.checkpoint.sharding import ModelSharding, is_fp8_state

LAYER_FILE = re.compile(r"^layer_(?P<layer>\d+)-model_(?P<rank>\d+)-model_states\.pt$")


class LayerFilesError(ValueError):
    """The layer files of a checkpoint directory are missing or incomplete."""


@dataclass(frozen=True)
class LayerFiles:
    """``paths[layer]``: the file of each TP rank of that layer, in rank order."""

    directory: str
    paths: dict[int, list[str]]

    @property
    def tp_size(self) -> int:
        return len(next(iter(self.paths.values())))

    @property
    def layers(self) -> list[int]:
        return sorted(self.paths)


def find_layer_files(directory: str) -> LayerFiles:
    """The layer files of ``directory`` (a ``global_stepN``); LayerFilesError names what is missing."""
    if not os.path.isdir(directory):
        raise LayerFilesError(f"{directory}: no such checkpoint directory")
    ranks: dict[int, dict[int, str]] = {}
    for name in os.listdir(directory):
        match = LAYER_FILE.match(name)
        if match:
            ranks.setdefault(int(match["layer"]), {})[int(match["rank"])] = os.path.join(directory, name)
    if not ranks:
        raise LayerFilesError(f"{directory}: no layer_XX-model_TT-model_states.pt file (not a pipeline-engine "
                              f"checkpoint directory)")
    tp_size = max(rank for found in ranks.values() for rank in found) + 1
    for layer, found in sorted(ranks.items()):
        missing = sorted(set(range(tp_size)) - set(found))
        if missing:
            names = ", ".join(layer_file_name(layer, rank) for rank in missing)
            raise LayerFilesError(f"{directory}: {names} missing (the other layers have {tp_size} TP ranks)")
    return LayerFiles(directory, {layer: [found[rank] for rank in range(tp_size)] for layer, found in ranks.items()})


def read_full_layer(files: LayerFiles, layer: int, sharding: ModelSharding) -> dict[str, torch.Tensor]:
    """Layer ``layer``'s state dict with every parameter merged over the TP ranks as ``sharding``
    splits it, without FP8 scaling state (``sharding.is_fp8_state``). Only this layer's files are in memory."""
    states = [{name: value for name, value in torch.load(path, map_location="cpu", weights_only=True).items()
               if not is_fp8_state(name)} for path in files.paths[layer]]
    names = list(states[0])
    for path, state in zip(files.paths[layer][1:], states[1:]):
        if list(state) != names:
            raise LayerFilesError(f"{path}: parameters {sorted(state)} differ from rank 0's {sorted(names)}")
    try:
        splits = sharding.layer_splits(layer, names)
    except ParameterNameError as error:
        raise LayerFilesError(f"{files.paths[layer][0]}: {error}") from None
    return {name: merge_partitions([state[name] for state in states], splits[name]) for name in names}


def layer_file_name(layer: int, tp_rank: int) -> str:
    return f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt"


def write_layer(directory: str, layer: int, full_state: dict[str, torch.Tensor], tp_size: int,
                sharding: ModelSharding) -> list[str]:
    """Write layer ``layer`` of ``full_state`` (full tensors) as its ``tp_size`` partition files, split
    as ``sharding`` says, in ``directory``, each under a temporary name renamed when written; returns
    the paths in rank order. Vocabulary rows must already be padded to a multiple of ``tp_size``."""
    parts = {name: split_partitions(value, sharding.layer_split(layer, name), tp_size)
             for name, value in full_state.items()}
    paths = []
    for rank in range(tp_size):
        path = os.path.join(directory, layer_file_name(layer, rank))
        handle, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
        os.close(handle)
        try:
            save_torch_file({name: parts[name][rank] for name in full_state}, temporary)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
        paths.append(path)
    return paths
