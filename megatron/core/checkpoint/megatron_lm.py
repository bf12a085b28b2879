"""A checkpoint's weights written in Megatron-LM's own layout (the one Megatron uses without DeepSpeed),
at any TP and PP size:

    OUTPUT/latest_checkpointed_iteration.txt                       "N" (or "release")
    OUTPUT/iter_{N:07d}/mp_rank_{TT:02d}/model_optim_rng.pt          PP = 1
    OUTPUT/iter_{N:07d}/mp_rank_{TT:02d}_{PPP:03d}/model_optim_rng.pt  PP > 1
    (a release checkpoint: OUTPUT/release/... instead of iter_N, iteration 0 and no consumed samples)

Each file holds ``args`` (a namespace of plain values read by attribute, as Megatron's argparse
Namespace is: the model's sizes and options under their flag names, the layout, the counters, the
tokenizer), ``checkpoint_version`` 3.0,
``iteration``, ``tokens``, ``checkpoint_info`` and ``model``:

    {"language_model": {"embedding": {"word_embeddings": {"weight"},          first stage
                                      "position_embeddings": {"weight"},      learned positions
                                      "embed_layernorm": {"weight", "bias"}}, --embed-layernorm
                        "encoder": {"layers.<i>.<our layer's names>": ...,     i from 0 on every stage
                                    "final_layernorm.weight" / ".bias"},      last stage
                        "output_layer": {"weight"}},                           last stage, untied head
     "word_embeddings_for_head": {"weight"}}                                   last stage, PP > 1, tied head

Each stage holds L / PP consecutive transformer layers. The TP split of each tensor is the
trainer's (sharding.py), which is Megatron-LM's: grouped-query attention's QKV rows are per key/value
group [its query heads; key; value], split over TP by whole groups; SwiGLU's first MLP weight holds
[A_r; G_r] on rank r. ``args`` carry Megatron-LM's flags of these options too (``group_query_attention``,
``swiglu``, ``position_embedding_type`` "rope" for rotary). There is no optimizer, LR schedule or
RNG state: weights only.

Memory: the layers of one pipeline stage (a rank's file holds all of them; the stage's TP files are
written once its last layer is read), plus the word embeddings kept for the last stage's head.
"""
import os
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron.core.checkpoint.names import EMBEDDING_LAYER, FIRST_TRANSFORMER_LAYER, final_norm_layer, output_layer
from megatron.core.checkpoint.latest import write_tracker
from megatron.core.checkpoint.output import save_torch_file, staged_directory, write_tree_manifest
from megatron.core.checkpoint.partitions import TensorSplit, split_partitions
from megatron.core.checkpoint.reader import CheckpointInputError, SavedCheckpoint, iter_full_layers
from megatron.core.checkpoint.writer import check_target_layout, padded_rows, target_padded_vocab_size
from megatron.core.dtypes import torch_dtype

CHECKPOINT_VERSION = 3.0


@dataclass(frozen=True)
class WrittenMegatronLM:
    directory: str
    iteration_directory: str
    tp: int
    pp: int
    padded_vocab_size: int


def rank_directory(tp_rank: int, pp_rank: int, pp: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def megatron_lm_arguments(checkpoint: SavedCheckpoint, tp: int, pp: int, padded: int, release: bool) -> types.SimpleNamespace:
    """Megatron's ``args``: the saved model's fields, the layout, the counters and the tokenizer."""
    model = {**checkpoint.model, "padded_vocab_size": padded}
    model["params_dtype"] = torch_dtype(str(model["params_dtype"]).removeprefix("torch."), "args.model.params_dtype")
    data = checkpoint.state["args"].get("config", {}).get("data", {})
    counters = {key: 0 if release else checkpoint.state.get(key, 0)
                for key in ("consumed_train_samples", "consumed_valid_samples", "consumed_train_tokens")}
    tokenizer = {key: data.get(key) for key in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_name_or_path")}
    return types.SimpleNamespace(**{**model, **megatron_lm_model_flags(model)}, **counters, **tokenizer,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, iteration=0 if release else checkpoint.iteration,
        fp16=model["params_dtype"] == torch.float16, bf16=model["params_dtype"] == torch.bfloat16)


def megatron_lm_model_flags(model: dict) -> dict:
    """Megatron-LM's names of the saved model's options that ours spell otherwise."""
    heads = model["num_attention_heads"]
    groups = model.get("num_query_groups") or heads
    rotary = model.get("position_embedding_type") == "rotary"
    return {"group_query_attention": groups != heads, "num_query_groups": groups,
            "swiglu": model.get("glu_activation") == "swiglu",
            "position_embedding_type": "rope" if rotary else model.get("position_embedding_type"),
            "norm_epsilon": model.get("layernorm_epsilon")}


class _StageFiles:
    """One pipeline stage's tensors with their splits, gathered layer by layer and written as its TP
    ranks' files."""

    def __init__(self, root: str, header: dict, tp: int, pp: int):
        self.root, self.header, self.tp, self.pp = root, header, tp, pp
        self.embedding: dict[str, dict[str, tuple[torch.Tensor, TensorSplit]]] = {}
        self.encoder: dict[str, tuple[torch.Tensor, TensorSplit]] = {}
        self.head: tuple[torch.Tensor, TensorSplit] | None = None
        self.output_layer: tuple[torch.Tensor, TensorSplit] | None = None

    def _parts(self, tensors: dict[str, tuple[torch.Tensor, TensorSplit]]) -> dict[str, list[torch.Tensor]]:
        return {name: split_partitions(tensor, split, self.tp) for name, (tensor, split) in tensors.items()}

    def write(self, stage: int) -> None:
        encoder = self._parts(self.encoder)
        embedding = {module: self._parts(tensors) for module, tensors in self.embedding.items()}
        head = self._parts({"weight": self.head}) if self.head is not None else None
        untied = self._parts({"weight": self.output_layer}) if self.output_layer is not None else None
        for rank in range(self.tp):
            language_model = {"encoder": {name: parts[rank] for name, parts in encoder.items()}}
            if embedding:
                language_model["embedding"] = {module: {p: parts[rank] for p, parts in tensors.items()}
                                               for module, tensors in embedding.items()}
            if untied is not None:
                language_model["output_layer"] = {"weight": untied["weight"][rank]}
            model = {"language_model": language_model}
            if head is not None:
                model["word_embeddings_for_head"] = {"weight": head["weight"][rank]}
            directory = os.path.join(self.root, rank_directory(rank, stage, self.pp))
            os.makedirs(directory)
            save_torch_file({**self.header, "model": model}, os.path.join(directory, "model_optim_rng.pt"))
        self.embedding, self.encoder, self.head, self.output_layer = {}, {}, None, None


def write_megatron_lm_checkpoint(checkpoint: SavedCheckpoint, output: str, tp: int, pp: int, release: bool = False,
                                 on_layer: Callable[[int], None] = lambda layer: None) -> WrittenMegatronLM:
    """``checkpoint``'s weights in Megatron-LM's layout under ``output`` (module docstring)."""
    check_target_layout(checkpoint.model, tp, pp)
    num_layers = checkpoint.model["num_layers"]
    if num_layers % pp:
        raise CheckpointInputError(f"--target_pp {pp}: Megatron-LM gives every stage the same number of layers, and "
                                   f"{num_layers} layers do not split into {pp} stages")
    per_stage, padded = num_layers // pp, target_padded_vocab_size(checkpoint.model["padded_vocab_size"], tp)
    arguments = megatron_lm_arguments(checkpoint, tp, pp, padded, release)
    untied = bool(checkpoint.model.get("untie_embeddings_and_output_weights"))
    header = {"args": arguments, "checkpoint_version": CHECKPOINT_VERSION, "iteration": arguments.iteration,
              "tokens": arguments.consumed_train_tokens,
              "checkpoint_info": {**checkpoint.state["checkpoint_info"], "padded_vocab_size": padded}}
    name = "release" if release else f"iter_{checkpoint.iteration:07d}"
    with staged_directory(output) as staging:
        root = os.path.join(staging, name)
        stage_files, stage, words = _StageFiles(root, header, tp, pp), 0, None
        for layer, state in iter_full_layers(checkpoint):
            entries = {key: (tensor, checkpoint.sharding.layer_split(layer, key)) for key, tensor in state.items()}
            if layer == EMBEDDING_LAYER:
                table, table_split = entries.pop("word_embeddings.weight")
                words = (padded_rows(table, padded), table_split)
                stage_files.embedding["word_embeddings"] = {"weight": words}
                for module, _, p in (key.rpartition(".") for key in entries):
                    stage_files.embedding.setdefault(module, {})[p] = entries[f"{module}.{p}"]
            elif layer == final_norm_layer(num_layers):
                stage_files.encoder.update({f"final_layernorm.{p}": entry for p, entry in entries.items()})
                stage_files.head = words if pp > 1 and not untied else None
            elif layer == output_layer(num_layers):
                weight, split = entries["weight"]
                stage_files.output_layer = (padded_rows(weight, padded), split)
            else:
                index = layer - FIRST_TRANSFORMER_LAYER
                if index // per_stage != stage:
                    stage_files.write(stage)
                    stage = index // per_stage
                stage_files.encoder.update({f"layers.{index % per_stage}.{key}": entry
                                            for key, entry in entries.items()})
            on_layer(layer)
        stage_files.write(stage)
        if checkpoint.unverified is None:  # no manifest vouches for unverified input
            write_tree_manifest(root, arguments.iteration)
        write_tracker(staging, "release" if release else str(checkpoint.iteration))
    return WrittenMegatronLM(os.path.normpath(output), name, tp, pp, padded)
