"""A saved checkpoint opened for conversion: located, validated, described.

``open_checkpoint(path)`` takes a tag directory (``global_stepN``) or a --save directory whose
``latest`` names one, and refuses, naming the file, anything the trainer would refuse to resume: a
save that never finished (its ``saving.incomplete`` marker), a file the manifest lists that is
missing, truncated or fails its CRC-32, a directory without model-states files or trainer state, a
checkpoint of this trainer without its manifest unless the caller allows it (origin.py; it is then
``unverified``, and a writer gives its output no manifest either).
The optimizer partitions, several times the weights' size, are read for their CRC-32 only by a
caller that reads them (``read_optimizer``); for the others their presence and size are checked.
It then describes the checkpoint from its first model-states file: the model configuration, the
TP / PP / DP sizes, the engine (pipeline: weights in layer files; plain: in the model-states
files), the optimizer files, and the trainer's counters.

``iter_full_layers`` streams the weights one pipeline layer at a time as full tensors (TP
partitions merged, names of the layer's own state dict), whichever engine wrote them.
"""
import fnmatch
import glob
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterator

import torch

from megatron.core.checkpoint.latest import LATEST, LatestError, read_latest
from megatron.core.checkpoint.layer_files import LayerFilesError, find_layer_files, read_full_layer
from megatron.core.checkpoint.manifest import MANIFEST_NAME, SAVING_MARKER, ManifestError, read_manifest
from megatron.core.checkpoint.names import EMBEDDING_LAYER, pipeline_name
from megatron.core.checkpoint.origin import UnverifiedCheckpointError, unverified_reading_line
from megatron.core.checkpoint.partitions import merge_partitions
from megatron.core.checkpoint.sharding import ModelSharding, is_fp8_state

MODEL_STATES = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
OPTIMIZER_FILES = "*zero_pp_rank_*_mp_rank_*_optim_states.pt"


class CheckpointInputError(ValueError):
    """The checkpoint cannot be converted; the message names the file or flag."""


@dataclass(frozen=True)
class SavedCheckpoint:
    """What open_checkpoint found.

    Attributes:
        directory: the tag directory.
        state: the trainer state of mp_rank_00 (counters, ``args``, ``checkpoint_info``, the LR schedule).
        model: the model configuration as saved (``args.model``: plain values).
        tp, pp, dp: the parallel sizes it was saved with.
        pipeline: saved by the pipeline engine (weights in layer files).
        optimizer_files: the ZeRO optimizer partitions (empty at ZeRO stage 0).
        unverified: None when a manifest verified the files; else the notice or warning the caller
            prints (origin.unverified_reading_line). A conversion writes no manifest for such input.
    """

    directory: str
    state: dict = field(repr=False)
    model: dict
    tp: int
    pp: int
    dp: int
    pipeline: bool
    optimizer_files: tuple[str, ...]
    unverified: str | None = None

    @property
    def iteration(self) -> int:
        return int(self.state["iteration"])

    @cached_property
    def sharding(self) -> ModelSharding:
        """How the saved model's parameters are split over TP ranks, read from its layers (sharding.py)."""
        try:
            return ModelSharding.of_saved(self.model)
        except ValueError as error:
            raise CheckpointInputError(f"{self.directory}: the model it records cannot be built ({error})") from None

    @property
    def fp8_notice(self) -> str | None:
        """The line a tool prints for a checkpoint with FP8 delayed-scaling state, which it does not carry."""
        fp8 = self.model.get("fp8")
        if not isinstance(fp8, dict) or fp8.get("recipe") != "delayed":
            return None
        return (f"notice: {self.directory} was trained in FP8: its delayed-scaling state (amax histories, scales) "
                f"is dropped, the weights are carried")

    @property
    def original_vocab_size(self) -> int:
        return int(self.state["checkpoint_info"]["original_vocab_size"])


def resolve_tag_directory(path: str, flag: str = "--input_folder") -> str:
    """``path`` itself if it holds model-states files, else the tag its ``latest`` names."""
    if not os.path.isdir(path):
        raise CheckpointInputError(f"{flag} {path}: no such directory")
    if glob.glob(os.path.join(path, "mp_rank_*_model_states.pt")):
        return path
    try:
        tag = read_latest(path)
    except LatestError as error:
        raise CheckpointInputError(str(error)) from None
    if tag is not None:
        if os.path.isdir(os.path.join(path, tag)):
            return os.path.join(path, tag)
        raise CheckpointInputError(f"{os.path.join(path, LATEST)} names {tag!r}, which is not a directory of {path}")
    raise CheckpointInputError(f"{flag} {path} is not a checkpoint: it holds no mp_rank_*_model_states.pt file "
                               f"and no 'latest' file (give a global_stepN directory or the --save directory)")


def verify_files(directory: str, read_optimizer: bool = True) -> int | None:
    """Every file of the manifest present with its size, and its CRC-32 unless it is an optimizer
    partition and not ``read_optimizer``; returns how many CRCs were checked, None without a manifest."""
    if os.path.exists(os.path.join(directory, SAVING_MARKER)):
        raise CheckpointInputError(f"{directory} is a save that never finished ({SAVING_MARKER} is still there): "
                                   f"convert an earlier checkpoint")
    try:
        manifest = read_manifest(directory)
        if manifest is None:
            return None
        manifest.check_present(directory)
        names = [name for name in sorted(manifest.files)
                 if read_optimizer or not fnmatch.fnmatch(os.path.basename(name), OPTIMIZER_FILES)]
        for name in names:
            manifest.verify_file(os.path.join(directory, name), directory)
    except ManifestError as error:
        raise CheckpointInputError(str(error)) from None
    return len(names)


def _model_states_files(directory: str) -> list[str]:
    found = sorted((int(m[1]), name) for name in os.listdir(directory) if (m := MODEL_STATES.match(name)))
    if not found:
        raise CheckpointInputError(f"{directory} holds no mp_rank_*_model_states.pt: the checkpoint is incomplete")
    missing = sorted(set(range(found[-1][0] + 1)) - {rank for rank, _ in found})
    if missing:
        raise CheckpointInputError(f"{directory}: mp_rank_{missing[0]:02d}_model_states.pt is missing")
    return [os.path.join(directory, name) for _, name in found]


def load_file(path: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError, ValueError) as error:
        raise CheckpointInputError(f"cannot read {path} ({type(error).__name__}: {error})") from None


def open_checkpoint(path: str, flag: str = "--input_folder", read_optimizer: bool = False,
                    allow_missing_manifest: bool = False) -> SavedCheckpoint:
    """The checkpoint at ``path`` (module docstring); CheckpointInputError names what is wrong.
    ``allow_missing_manifest``: the flag spelled like ``flag`` (--allow_missing_manifest beside
    --input_folder, --allow-missing-manifest beside --load) was given."""
    directory = resolve_tag_directory(path, flag)
    verified = verify_files(directory, read_optimizer) is not None
    model_files = _model_states_files(directory)
    state = load_file(model_files[0])
    arguments = state.get("args")
    if not isinstance(arguments, dict) or "model" not in arguments or "iteration" not in state:
        raise CheckpointInputError(f"{model_files[0]} holds no trainer state (args.model, iteration): the checkpoint "
                                   f"was not written by this trainer")
    unverified = None if verified else _unverified_line(directory, state, allow_missing_manifest, flag)
    tp, pp = arguments["tensor_model_parallel_size"], arguments["pipeline_model_parallel_size"]
    if len(model_files) != tp * pp:
        raise CheckpointInputError(f"{directory}: {len(model_files)} mp_rank files for TP {tp} x PP {pp}: the "
                                   f"checkpoint is incomplete")
    pipeline = bool(glob.glob(os.path.join(directory, "layer_*-model_*-model_states.pt")))
    return SavedCheckpoint(directory, {k: v for k, v in state.items() if k != "module"}, arguments["model"], tp, pp,
                           arguments["data_parallel_size"], pipeline,
                           tuple(sorted(glob.glob(os.path.join(directory, OPTIMIZER_FILES)))), unverified)


def _unverified_line(directory: str, state: dict, allowed: bool, flag: str) -> str:
    allow_flag = "--allow_missing_manifest" if "_" in flag else "--allow-missing-manifest"
    try:
        return unverified_reading_line(directory, state, allowed, allow_flag,
                                       f"restore its {MANIFEST_NAME} or convert another checkpoint")
    except UnverifiedCheckpointError as error:
        raise CheckpointInputError(str(error)) from None


def iter_full_layers(checkpoint: SavedCheckpoint) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(pipeline layer index, its full state dict), layer by layer (module docstring)."""
    if not checkpoint.pipeline:
        yield from _plain_engine_layers(checkpoint)
        return
    try:
        files = find_layer_files(checkpoint.directory)
        if files.tp_size != checkpoint.tp:
            raise CheckpointInputError(f"{checkpoint.directory}: layer files of {files.tp_size} TP ranks, the "
                                       f"checkpoint says TP {checkpoint.tp}")
        for layer in files.layers:
            yield layer, read_full_layer(files, layer, checkpoint.sharding)
    except LayerFilesError as error:
        raise CheckpointInputError(str(error)) from None


def _plain_engine_layers(checkpoint: SavedCheckpoint):
    """The plain engine (PP 1) keeps each TP rank's whole module in mp_rank_TT: read them all (one
    model's weights, split TP ways) and regroup by pipeline layer."""
    modules = [load_file(path)["module"] for path in _model_states_files(checkpoint.directory)]
    layers: dict[int, dict[str, torch.Tensor]] = {}
    num_layers = checkpoint.model["num_layers"]
    for name in (name for name in modules[0] if not is_fp8_state(name)):
        layer, _, local = pipeline_name(name, num_layers).partition(".")
        index = EMBEDDING_LAYER if layer == "tied_modules" else int(layer)
        local = local.removeprefix("embed.")
        layers.setdefault(index, {})[local] = merge_partitions([module[name] for module in modules],
                                                               checkpoint.sharding.split(name))
    for index in sorted(layers):
        yield index, layers.pop(index)
