"""A checkpoint's weights written again under another TP and PP size, in the pipeline engine's
layout (docs/checkpoint-format.md), one layer at a time.

What the output holds: the layer files at the target TP size (the layer numbering does not depend
on PP: the pipeline module assigns layers to stages when it loads), one model-states file per
(stage, TP rank) with the source's trainer state (counters, LR schedule, model configuration) and
the new sizes, a manifest (none when the source was read unverified: reader.py), ``latest`` and
``latest_checkpointed_iteration.txt``. What it does not
hold: optimizer states and RNG states, which belong to the source's ranks. Resume it with
``--no-load-optim --no-load-rng`` (the schedule and counters continue) or ``--finetune``; for the
optimizer state, convert to a universal checkpoint instead.

The vocabulary: the word embeddings and the untied output layer keep the source's padded rows
(trained padding, which the softmax sees) when the padded size divides by the target TP size;
otherwise zero rows are added up to the next multiple, and the resumed run needs
``--pad-vocab-size-to`` that size.
"""
import os
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from megatron.core.checkpoint.layer_files import write_layer
from megatron.core.checkpoint.names import EMBEDDING_LAYER, output_layer
from megatron.core.checkpoint.latest import checkpoint_tag, write_latest
from megatron.core.checkpoint.output import save_torch_file, staged_directory, write_tree_manifest
from megatron.core.checkpoint.reader import CheckpointInputError, SavedCheckpoint, iter_full_layers
from megatron.core.checkpoint.sharding import NO_FP8, ModelSharding
from megatron.core.checkpoint.universal import UNIVERSAL_CHECKPOINT_INFO, universal_info
from megatron.core.checkpoint.universal_writer import OPTIMIZER_PARAMETER_NAMES

RANK_STATES = ("random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states",
               "optimizer", "module", "param_shapes", OPTIMIZER_PARAMETER_NAMES)


@dataclass(frozen=True)
class WrittenCheckpoint:
    directory: str
    tag: str
    tp: int
    pp: int
    dp: int
    padded_vocab_size: int
    layers: int


def check_target_layout(model: dict, tp: int, pp: int, flags: tuple[str, str] = ("--target_tp", "--target_pp")) -> None:
    """The heads, the key/value groups, the MLP and the layers must split into the target sizes."""
    heads, ffn, layers = model["num_attention_heads"], model["ffn_hidden_size"], model["num_layers"]
    if tp < 1 or heads % tp or ffn % tp:
        raise CheckpointInputError(f"{flags[0]} {tp}: the model's {heads} attention heads and MLP width {ffn} must "
                                   f"divide by the tensor-parallel size")
    groups = model.get("num_query_groups") or heads
    if groups % tp:
        raise CheckpointInputError(f"{flags[0]} {tp}: the TP ranks split the model's {groups} key/value groups "
                                   f"(grouped-query attention) whole; use a TP size that divides {groups}")
    if pp < 1 or pp > layers:
        raise CheckpointInputError(f"{flags[1]} {pp}: the model has {layers} transformer layers; each of the "
                                   f"pipeline stages needs at least one")


def target_padded_vocab_size(padded: int, tp: int) -> int:
    """The source's padded vocabulary if ``tp`` divides it, else the next multiple of ``tp``."""
    return -(-padded // tp) * tp


def padded_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    if weight.shape[0] == rows:
        return weight
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


def _trainer_state(checkpoint: SavedCheckpoint, tp: int, pp: int, dp: int, padded: int) -> dict:
    """The source's trainer state with the new layout; without what belongs to the source's ranks."""
    state = {key: value for key, value in checkpoint.state.items() if key not in RANK_STATES}
    model = {**checkpoint.model, **NO_FP8, "padded_vocab_size": padded}  # the weights only: no FP8 state
    arguments = {**state["args"], "model": model, "tensor_model_parallel_size": tp,
                 "pipeline_model_parallel_size": pp, "data_parallel_size": dp}
    state.update(args=arguments, module=None, optimizer=None, mp_world_size=tp * pp, dp_world_size=dp,
                 checkpoint_info={**state["checkpoint_info"], "padded_vocab_size": padded})
    state[UNIVERSAL_CHECKPOINT_INFO] = universal_info(checkpoint.sharding, pipeline=True, padded_vocab_size=padded,
                                                      original_vocab_size=checkpoint.original_vocab_size)
    return state


def write_checkpoint(output: str, iteration: int, layers: Iterable[tuple[int, dict[str, torch.Tensor]]],
                     trainer_state: dict, tp: int, pp: int, sharding: ModelSharding,
                     on_layer: Callable[[int], None] = lambda layer: None, flag: str = "--output_folder",
                     before_commit: Callable[[str], None] = lambda staging: None, manifest: bool = True) -> int:
    """The pipeline engine's files of ``layers`` ((pipeline layer index, full state dict), vocabulary
    already padded) at TP ``tp``, split as ``sharding`` says, with ``trainer_state`` as every (stage,
    TP rank)'s model-states file, under ``output`` (a --save directory, ``global_step{iteration}``
    inside); staged, with a manifest unless not ``manifest`` (unverified input), then ``latest``;
    ``before_commit(staging directory)`` may add files beside the tag. Returns the number of layers
    written."""
    tag = checkpoint_tag(iteration)
    with staged_directory(output, flag) as staging:
        tag_directory = os.path.join(staging, tag)
        os.makedirs(tag_directory)
        written = 0
        for layer, state in layers:
            write_layer(tag_directory, layer, state, tp, sharding)
            written += 1
            on_layer(layer)
        for rank in range(tp * pp):
            save_torch_file(trainer_state, os.path.join(tag_directory, f"mp_rank_{rank:02d}_model_states.pt"))
        if manifest:
            write_tree_manifest(tag_directory, iteration)
        before_commit(staging)
        write_latest(staging, iteration)
    return written


def write_model_checkpoint(checkpoint: SavedCheckpoint, output: str, tp: int, pp: int, dp: int = 1,
                           on_layer: Callable[[int], None] = lambda layer: None,
                           flag: str = "--output_folder") -> WrittenCheckpoint:
    """Write ``checkpoint``'s weights under ``output`` (a --save directory: ``global_stepN`` inside) at
    TP ``tp`` and PP ``pp`` (module docstring); ``on_layer`` is called after each layer is written."""
    check_target_layout(checkpoint.model, tp, pp)
    padded = target_padded_vocab_size(checkpoint.model["padded_vocab_size"], tp)
    vocabulary_tables = {EMBEDDING_LAYER: "word_embeddings.weight",
                         output_layer(checkpoint.model["num_layers"]): "weight"}

    def padded_layers():
        for layer, state in iter_full_layers(checkpoint):
            if layer in vocabulary_tables:
                key = vocabulary_tables[layer]
                state[key] = padded_rows(state[key], padded)
            yield layer, state

    trainer_state = _trainer_state(checkpoint, tp, pp, dp, padded)
    layers = write_checkpoint(output, checkpoint.iteration, padded_layers(), trainer_state, tp, pp,
                              checkpoint.sharding, on_layer, flag, manifest=checkpoint.unverified is None)
    return WrittenCheckpoint(os.path.normpath(output), checkpoint_tag(checkpoint.iteration), tp, pp, dp, padded, layers)


def resume_advice(written: WrittenCheckpoint, source_padded: int) -> str:
    """How to resume the written checkpoint (module docstring)."""
    flags = (f"--load {written.directory} --tensor-model-parallel-size {written.tp} "
             f"--pipeline-model-parallel-size {written.pp} --no-load-optim --no-load-rng")
    if written.padded_vocab_size != source_padded:
        flags += f" --pad-vocab-size-to {written.padded_vocab_size}"
    return f"resume with {flags} (or --finetune)"
