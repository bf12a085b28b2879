"""A DeepSpeed universal checkpoint written from a ZeRO (stage 1 or 2) checkpoint one layer at a time.

DeepSpeed's own conversion (deepspeed.checkpoint.ds_to_universal) loads each optimizer partition
file whole, and writes every fragment of every parameter to a temporary file before merging them:
its memory grows with the model and its disk traffic is three times the output. Here the partition
files are memory-mapped and reopened for each pipeline layer, so only that layer's pages are read
and they are released when the layer is written: the peak is one layer's fp32 weights and Adam
moments (times the workers), whatever the depth.

The output is what DeepSpeed's conversion writes and its ``load_universal`` reads:

    zero/<pipeline name>/fp32.pt, exp_avg.pt, exp_avg_sq.pt   {"param": the full tensor, plus
        "cat_dim" for a TP-split tensor, "vocab_tensor" for the word embeddings, and
        "param_n_sub_params" s for a tensor split with stride s (a GLU's first MLP weight: 2 halves)}
    zero/<pipeline name>/step.pt                                Adam's step count
    zero/optimizer_state.pt                                     the optimizer's settings and param_groups

A full tensor is the TP slices put together (partitions.py: TP-replicated tensors averaged, as
DeepSpeed does), each slice being its fragments from the DP partitions in rank order. The word
embeddings keep their padded rows (DeepSpeed's conversion cuts them; tools/convert_checkpoint/
ds_to_universal.py says why). Parameter folders carry the pipeline module's names whichever engine
saved the checkpoint (names.py).

At ZeRO stage 0 (fp32) there are no partitions: each model-states file holds its ranks' torch
optimizer state, which numbers the parameters in group order, and the trainer's
``optimizer_parameter_names`` names them; the fp32 weights are the layer files' weights.

Partition files: ``[bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt``, mp = pp * TP + tp;
their ``param_slice_mappings`` give each parameter's fragment (start, numel) in the partition's flat
group, and the model-states file ``mp_rank_{mp:02d}_model_states.pt`` its shape on that TP rank
(``param_shapes``). A ZeRO-3 partition file has no mappings: its flat group g (``fp32_flat_groups``,
the moments in the torch state's entry g) holds, for each parameter of ``param_shapes[g]`` in order,
the ceil(n / DP) elements of rank d's share (elements [d * ceil(n / DP), ...) of the TP slice
flattened, the last share zero-padded), which ``zero3_partition_view`` turns into the same fragments.

``zero/optimizer_state.pt`` also carries, under ``optimizer_state_dict``, the step and the parameter
groups where DeepSpeed's ZeRO-3 universal load reads them, so that either stage loads it.
"""
import math
import multiprocessing
import os
import re
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from megatron.core.checkpoint.layer_files import find_layer_files, read_full_layer
from megatron.core.checkpoint.names import EMBEDDING_LAYER, as_pipeline_name
from megatron.core.checkpoint.output import save_torch_file
from megatron.core.checkpoint.partitions import TensorSplit, merge_partitions
from megatron.core.checkpoint.reader import CheckpointInputError, SavedCheckpoint
from megatron.core.checkpoint.sharding import ModelSharding

PARTITION_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
STATES = ("fp32", "exp_avg", "exp_avg_sq")
SHARDED_KEYS = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")
# Present on the first and the last pipeline stage (the tied embedding): converted from the first.
PIPELINE_REPLICATED_PREFIX = "tied_modules."
# The trainer's model-states entry at ZeRO stage 0: the optimizer's parameter names, group by group.
OPTIMIZER_PARAMETER_NAMES = "optimizer_parameter_names"


@dataclass
class Parameter:
    """One parameter of one pipeline stage: its group, its fragments and its TP-local shape per rank."""

    name: str              # as the saving engine named it
    group: int
    fragments: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # (tp, dp) -> (start, numel)
    shapes: dict[int, torch.Size] = field(default_factory=dict)                       # tp -> shape


@dataclass(frozen=True)
class LayerTask:
    """What one worker converts: one pipeline layer's parameters on one stage."""

    stage: int
    parameters: tuple[Parameter, ...]


def _load_mapped(path: str) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except (OSError, RuntimeError, EOFError, ValueError) as error:
        raise CheckpointInputError(f"cannot read {path} ({type(error).__name__}: {error})") from None


class PartitionFiles:
    """The ZeRO partition files of a checkpoint directory by (pp, tp, dp)."""

    def __init__(self, checkpoint: SavedCheckpoint):
        self.directory, self.tp, self.pp, self.dp = checkpoint.directory, checkpoint.tp, checkpoint.pp, checkpoint.dp
        self.paths: dict[tuple[int, int, int], str] = {}
        for path in checkpoint.optimizer_files:
            match = PARTITION_FILE.match(os.path.basename(path))
            if match:
                dp, mp = int(match[1]), int(match[2])
                self.paths[(mp // self.tp, mp % self.tp, dp)] = path
        wanted = {(p, t, d) for p in range(self.pp) for t in range(self.tp) for d in range(self.dp)}
        missing = sorted(wanted - set(self.paths))
        if missing:
            p, t, d = missing[0]
            raise CheckpointInputError(f"{self.directory}: the optimizer partition of pipeline stage {p}, TP rank {t}, "
                                       f"DP rank {d} is missing (zero_pp_rank_{d}_mp_rank_{p * self.tp + t:02d}_"
                                       f"optim_states.pt)")

    def optimizer_state(self, stage: int, tp: int, dp: int) -> dict:
        """The ``optimizer_state_dict`` of one partition, memory-mapped (tensors are read when touched);
        a ZeRO-3 partition as ZeRO 1/2's (``zero3_partition_view``)."""
        path = self.paths[(stage, tp, dp)]
        state = _load_mapped(path)
        optimizer = state.get("optimizer_state_dict")
        if isinstance(optimizer, dict) and "fp32_flat_groups" in optimizer:
            shapes = _load_mapped(self.model_states(stage, tp)).get("param_shapes")
            return zero3_partition_view(optimizer, shapes, dp, self.dp, state.get("ds_version"), path)
        if not isinstance(optimizer, dict) or "param_slice_mappings" not in optimizer:
            raise CheckpointInputError(f"{path} holds no ZeRO optimizer state with param_slice_mappings")
        return optimizer

    def model_states(self, stage: int, tp: int) -> str:
        return os.path.join(self.directory, f"mp_rank_{stage * self.tp + tp:02d}_model_states.pt")


class Fragment(NamedTuple):
    """Where one parameter's share lies in a partition's flat group (DeepSpeed's fragment address)."""

    start: int
    numel: int


def zero3_partition_view(optimizer: dict, shapes: list | None, dp_rank: int, dp: int, ds_version, path: str) -> dict:
    """ZeRO-3's partition of DP rank ``dp_rank`` (of ``dp``) as a ZeRO 1/2 partition: its flat groups
    as ``single_partition_of_fp32_groups``, the torch state as ``base_optimizer_state``, and the
    ``param_slice_mappings`` of the layout in the module docstring (a parameter's share without its
    padding); ``shapes`` are the model-states file's ``param_shapes``, one group per flat group."""
    flats = optimizer["fp32_flat_groups"]
    if not shapes or len(shapes) != len(flats):
        raise CheckpointInputError(f"{path}: {len(flats)} ZeRO-3 flat groups but the model-states file's "
                                   f"param_shapes has {len(shapes or [])} groups")
    mappings = []
    for group, names in enumerate(shapes):
        offset, fragments = 0, {}
        for name, shape in names.items():
            numel = math.prod(shape)
            share = math.ceil(numel / dp)
            fragments[name] = Fragment(offset, max(0, min(share, numel - dp_rank * share)))
            offset += share
        if offset != flats[group].numel():
            raise CheckpointInputError(f"{path}: flat group {group} holds {flats[group].numel()} elements, its "
                                       f"parameters' shares {offset}")
        mappings.append(fragments)
    common = {key: value for key, value in optimizer.items() if key not in ("fp32_flat_groups", "optimizer_state_dict")}
    return {**common, "ds_version": ds_version, "param_slice_mappings": mappings,
            "single_partition_of_fp32_groups": flats, "base_optimizer_state": optimizer["optimizer_state_dict"]}


def stage_parameters(files: PartitionFiles, stage: int) -> list[Parameter]:
    """The parameters of ``stage`` in the order of its flat groups, with their fragments and shapes."""
    parameters: dict[str, Parameter] = {}
    for tp in range(files.tp):
        shapes = _load_mapped(files.model_states(stage, tp)).get("param_shapes")
        if not shapes:
            raise CheckpointInputError(f"{files.model_states(stage, tp)} has no param_shapes (not a ZeRO checkpoint)")
        for dp in range(files.dp):
            mappings = files.optimizer_state(stage, tp, dp)["param_slice_mappings"]
            for group, fragments in enumerate(mappings):
                for name, fragment in fragments.items():
                    parameter = parameters.setdefault(name, Parameter(name, group))
                    parameter.fragments[(tp, dp)] = (int(fragment.start), int(fragment.numel))
                    parameter.shapes[tp] = torch.Size(shapes[group][name])
    return list(parameters.values())


def layer_tasks(files: PartitionFiles, num_layers: int) -> list[LayerTask]:
    """Every stage's parameters grouped by pipeline layer; the tied embedding only from the first stage."""
    tasks = []
    for stage in range(files.pp):
        layers: dict[str, list[Parameter]] = {}
        for parameter in stage_parameters(files, stage):
            name = as_pipeline_name(parameter.name, num_layers)
            if stage > 0 and name.startswith(PIPELINE_REPLICATED_PREFIX):
                continue
            layers.setdefault(name.split(".")[0], []).append(parameter)
        tasks += [LayerTask(stage, tuple(parameters)) for parameters in layers.values()]
    return tasks


def _tp_slice(states: dict, parameter: Parameter, tp: int, state: str) -> torch.Tensor:
    """One TP rank's slice of ``parameter``'s ``state``: its DP fragments in rank order, reshaped."""
    pieces = []
    for dp in range(len(states[tp])):
        if (tp, dp) not in parameter.fragments:
            continue
        start, numel = parameter.fragments[(tp, dp)]
        optimizer = states[tp][dp]
        flat = (optimizer["single_partition_of_fp32_groups"][parameter.group] if state == "fp32"
                else optimizer["base_optimizer_state"]["state"][parameter.group][state])
        pieces.append(flat.narrow(0, start, numel))
    return torch.cat(pieces).view(parameter.shapes[tp])


def _step(states: dict, parameter: Parameter):
    tp, dp = next(iter(parameter.fragments))
    return states[tp][dp]["base_optimizer_state"]["state"][parameter.group].get("step")


def convert_layer(files: PartitionFiles, task: LayerTask, sharding: ModelSharding, zero_directory: str) -> int:
    """Write the universal files of one pipeline layer (module docstring); returns the bytes written."""
    states = {tp: [files.optimizer_state(task.stage, tp, dp) for dp in range(files.dp)] for tp in range(files.tp)}
    written = 0
    for parameter in task.parameters:
        name = as_pipeline_name(parameter.name, sharding.num_layers)
        split = sharding.split(name)
        full = {state: merge_partitions([_tp_slice(states, parameter, tp, state) for tp in range(files.tp)], split)
                for state in STATES}
        written += _write_parameter(zero_directory, name, split, full, _step(states, parameter))
    return written


def _convert_in_worker(arguments) -> int:
    checkpoint, task, zero_directory = arguments
    return convert_layer(PartitionFiles(checkpoint), task, checkpoint.sharding, zero_directory)


def write_optimizer_state(files: PartitionFiles, zero_directory: str) -> None:
    """zero/optimizer_state.pt: the first partition's optimizer state without its sharded tensors,
    with the base optimizer's param_groups."""
    optimizer = files.optimizer_state(0, 0, 0)
    common = {key: value for key, value in optimizer.items() if key not in SHARDED_KEYS}
    base = optimizer["base_optimizer_state"]
    first = next(iter(base["state"].values()), {})
    save_torch_file({**common, **_global_settings(base["param_groups"], first.get("step"))},
                    os.path.join(zero_directory, "optimizer_state.pt"))


def _global_settings(param_groups: list[dict], step) -> dict:
    """The parameter groups where the ZeRO 1/2 universal load reads them (``param_groups``) and where the
    ZeRO-3 one does (``optimizer_state_dict``: step and groups)."""
    return {"param_groups": param_groups,
            "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": param_groups}}


def _stage0_optimizer(path: str) -> tuple[dict, dict[str, int]]:
    """(the torch optimizer state of a stage-0 model-states file, parameter name -> its index there)."""
    state = _load_mapped(path)
    names = state.get(OPTIMIZER_PARAMETER_NAMES)
    if state.get("optimizer") is None or names is None:
        raise CheckpointInputError(f"{path} holds no optimizer state with {OPTIMIZER_PARAMETER_NAMES} (a ZeRO stage 0 "
                                   f"checkpoint of an older trainer, or weights only): it cannot become universal")
    optimizer = state["optimizer"]
    indices = [index for group in optimizer["param_groups"] for index in group["params"]]
    ordered = [name for group in names for name in group]
    return optimizer, dict(zip(ordered, indices))


def convert_stage0_layer(checkpoint: SavedCheckpoint, layer_files, layer: int, zero_directory: str) -> int:
    """The universal files of pipeline layer ``layer`` of a ZeRO stage 0 checkpoint: the weights of the
    layer files as fp32, the moments and step from each (stage, TP rank)'s optimizer state."""
    num_layers = checkpoint.model["num_layers"]
    weights = read_full_layer(layer_files, layer, checkpoint.sharding)
    stage = stage_of_layer(checkpoint, layer)
    optimizers = [_stage0_optimizer(os.path.join(checkpoint.directory, f"mp_rank_{stage * checkpoint.tp + tp:02d}"
                                                 f"_model_states.pt")) for tp in range(checkpoint.tp)]
    written = 0
    for local, weight in weights.items():
        name = as_pipeline_name(f"{PIPELINE_REPLICATED_PREFIX}embed.{local}" if layer == EMBEDDING_LAYER
                                else f"{layer}.{local}", num_layers)
        split = checkpoint.sharding.split(name)
        saved = [optimizer["state"][indices[name]] for optimizer, indices in optimizers]
        full = {"fp32": weight.float(), **{state: merge_partitions([entry[state] for entry in saved], split)
                                           for state in STATES[1:]}}
        written += _write_parameter(zero_directory, name, split, full, saved[0].get("step"))
    return written


def stage_of_layer(checkpoint: SavedCheckpoint, layer: int) -> int:
    """The first pipeline stage whose model-states file names a parameter of ``layer``."""
    prefix = f"{PIPELINE_REPLICATED_PREFIX}" if layer == EMBEDDING_LAYER else f"{layer}."
    for stage in range(checkpoint.pp):
        names = _load_mapped(os.path.join(checkpoint.directory, f"mp_rank_{stage * checkpoint.tp:02d}_model_states.pt"
                                          )).get(OPTIMIZER_PARAMETER_NAMES) or []
        if any(name.startswith(prefix) for group in names for name in group):
            return stage
    raise CheckpointInputError(f"{checkpoint.directory}: no pipeline stage's optimizer names layer {layer}")


def _write_parameter(zero_directory: str, name: str, split: TensorSplit, full: dict[str, torch.Tensor], step) -> int:
    """zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt (module docstring); returns the bytes written."""
    folder = os.path.join(zero_directory, name)
    os.makedirs(folder, exist_ok=True)
    written = 0
    for state in STATES:
        entry = {"param": full[state].clone()}
        if not split.replicated:
            entry["cat_dim"] = split.dim
        if split.vocabulary:
            entry["vocab_tensor"] = True
        if split.stride > 1:
            entry["param_n_sub_params"] = split.stride
        path = os.path.join(folder, f"{state}.pt")
        save_torch_file(entry, path)
        written += os.path.getsize(path)
    if step is not None:
        save_torch_file(step, os.path.join(folder, "step.pt"))
    return written


def write_stage0_optimizer_state(checkpoint: SavedCheckpoint, zero_directory: str) -> None:
    """zero/optimizer_state.pt of a stage 0 checkpoint: the settings the ZeRO optimizer restores."""
    state = _load_mapped(os.path.join(checkpoint.directory, "mp_rank_00_model_states.pt"))
    optimizer = state["optimizer"]
    first = next(iter(optimizer["state"].values()), {})
    clip_grad = (state.get("ds_config") or {}).get("gradient_clipping", 0.0)
    groups = [{key: value for key, value in group.items() if key != "params"} for group in optimizer["param_groups"]]
    save_torch_file({"ds_version": state.get("ds_version"), "clip_grad": clip_grad,
                     **_global_settings(groups, first.get("step"))},
                    os.path.join(zero_directory, "optimizer_state.pt"))


def write_universal_zero(checkpoint: SavedCheckpoint, output: str, workers: int = 1,
                         on_layer: Callable[[], None] = lambda: None) -> int:
    """The ``zero/`` folder of the universal checkpoint of ``checkpoint`` under ``output``, layer by
    layer, ``workers`` layers at a time in separate processes (ZeRO 1 and 2; stage 0 in this process);
    returns the bytes of tensors written."""
    zero_directory = os.path.join(output, "zero")
    os.makedirs(zero_directory)
    if not checkpoint.optimizer_files:
        layer_files = find_layer_files(checkpoint.directory)
        written = 0
        for layer in layer_files.layers:
            written += convert_stage0_layer(checkpoint, layer_files, layer, zero_directory)
            on_layer()
        write_stage0_optimizer_state(checkpoint, zero_directory)
        return written
    files = PartitionFiles(checkpoint)
    tasks = layer_tasks(files, checkpoint.model["num_layers"])
    written = 0
    if workers <= 1:
        for task in tasks:
            written += convert_layer(files, task, checkpoint.sharding, zero_directory)
            on_layer()
    else:
        # spawn: a process forked from one running torch's threads can hang
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for size in pool.map(_convert_in_worker, [(checkpoint, task, zero_directory)
                                                       for task in tasks]):
                written += size
                on_layer()
    write_optimizer_state(files, zero_directory)
    return written
