"""One pipeline stage of the GPT model for inference, and its weights read from a training checkpoint.

Stage p of P holds a contiguous run of the transformer layers (``stage_layer_range``: as equal as
possible, the first stages taking one more when L is not a multiple of P, as DeepSpeed's partition
of the transformer layers does), plus the embedding on the first stage and the final LayerNorm and
the output head (tied to the word embeddings) on the last. Its modules are GPTModel's own
(Embedding, ParallelTransformerLayer, LayerNorm), so the function is the training model's; over a
key/value cache the layers run as decode_layers.py's steps, on the same weights.

Weights come from the layer files of any TP / PP layout (both engines): a rank reads only the layers
of its stage; when the checkpoint's TP is the run's, only its own partition file of each, otherwise
each full layer (partitions merged) and cuts out its own slice.
"""
import torch
from torch import nn

from megatron.core.checkpoint.layer_files import find_layer_files, read_full_layer
from megatron.core.checkpoint.names import EMBEDDING_LAYER, final_norm_layer, output_layer, transformer_layer
from megatron.core.checkpoint.partitions import split_partitions
from megatron.core.checkpoint.reader import CheckpointInputError, SavedCheckpoint, iter_full_layers
from megatron.core.models.gpt.config import GPTModelConfig
from megatron.core.models.gpt.embedding import Embedding, OutputLayer
from megatron.core.models.gpt.layer_norm import build_norm
from megatron.core.models.gpt.transformer_layer import ParallelTransformerLayer
from megatron.core.parallel_state import ParallelGroups
from megatron.core.text_generation.decode_layers import fuses_one_row_steps, layer_step


def stage_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The 0-based transformer layers of stage ``pp_rank``: L // P each, the first L % P stages one more."""
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} transformer layers cannot fill {pp_size} pipeline stages")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


class InferenceStage(nn.Module):
    """[Embedding (first stage)] -> transformer layers of ``stage_layer_range`` -> [LN_f, x W^T (last)].

    The last stage keeps an Embedding module of its own for the tied head (only its word embeddings
    are used there; with P = 1 it is the input embedding itself), or the untied output layer.
    """

    def __init__(self, config: GPTModelConfig, groups: ParallelGroups, device=None):
        super().__init__()
        self.config = config
        self.groups = groups
        self.layer_indices = stage_layer_range(config.num_layers, groups.pp_size, groups.pp_rank)
        untied = config.untie_embeddings_and_output_weights
        has_embedding = groups.is_first_stage or (groups.is_last_stage and not untied)
        self.embedding = Embedding(config, groups, device=device) if has_embedding else None
        self.output_layer = OutputLayer(config, groups, device) if groups.is_last_stage and untied else None
        self.layers = nn.ModuleList(ParallelTransformerLayer(config, index + 1, groups, device=device)
                                    for index in self.layer_indices)
        self.final_layernorm = None
        if groups.is_last_stage:
            self.final_layernorm = build_norm(config, device, sequence_parallel=False)
        self.fuses_one_row_steps = fuses_one_row_steps(config, groups.tp_size)

    @property
    def hidden_dtype(self) -> torch.dtype:
        """The dtype of the residual stream passed between stages."""
        return torch.float32 if self.config.fp32_residual_connection else self.config.params_dtype

    def forward(self, inputs: torch.Tensor, position_ids: torch.Tensor, kv_caches=None, body=None) -> torch.Tensor:
        """inputs: tokens [b, s] on the first stage, else the previous stage's hidden states [s, b, h];
        position_ids [b, s]; kv_caches: one per layer of the stage, or None (no cache: the s
        positions are the whole sequence); body: stands in for ``self.body`` (its compiled form), or
        None. Returns hidden states [s, b, h], on the last stage the logits [b, s, V / tp] of this
        rank's vocabulary slice."""
        hidden_states = inputs
        if self.groups.is_first_stage:
            # [b, s, h] -> [s, b, h] with the strides of a fresh tensor even where s = 1 (there
            # .contiguous() keeps the view), as the layers' outputs have: compiled code guards on them
            hidden_states = self.embedding(inputs, position_ids).transpose(0, 1).clone(
                memory_format=torch.contiguous_format)
        caches = [None] * len(self.layers) if kv_caches is None else list(kv_caches)
        return (self.body if body is None else body)(hidden_states, position_ids, caches)

    def body(self, hidden_states: torch.Tensor, position_ids: torch.Tensor, caches: list) -> torch.Tensor:
        """What follows the embedding: the layers (``caches``: one per layer, or None each), then on
        the last stage LN_f and the head. [s, b, h] -> [s, b, h], or the logits [b, s, V / tp]."""
        for layer, cache in zip(self.layers, caches):
            if cache is None:
                hidden_states = layer(hidden_states, position_ids)
            else:
                hidden_states = layer_step(layer, hidden_states, position_ids, cache, self.fuses_one_row_steps)
        if not self.groups.is_last_stage:
            return hidden_states
        hidden_states = self.final_layernorm(hidden_states)
        head = self.embedding.logits if self.output_layer is None else self.output_layer
        logits = head(hidden_states)  # [s, b, V / tp]
        return logits.transpose(0, 1)


def _module_prefixes(stage: InferenceStage) -> dict[int, str]:
    """Checkpoint layer index -> the stage's module prefix of that layer's state dict."""
    prefixes = {transformer_layer(index): f"layers.{local}." for local, index in enumerate(stage.layer_indices)}
    if stage.embedding is not None:
        prefixes[EMBEDDING_LAYER] = "embedding."
    if stage.final_layernorm is not None:
        prefixes[final_norm_layer(stage.config.num_layers)] = "final_layernorm."
    if stage.output_layer is not None:
        prefixes[output_layer(stage.config.num_layers)] = "output_layer."
    return prefixes


def _my_partition(checkpoint: SavedCheckpoint, layer: int, full_state: dict[str, torch.Tensor],
                  groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """This TP rank's slice of each full tensor of pipeline layer ``layer``."""
    return {name: split_partitions(tensor, checkpoint.sharding.layer_split(layer, name), groups.tp_size)[groups.tp_rank]
            for name, tensor in full_state.items()}


def _stage_layers(checkpoint: SavedCheckpoint, wanted: set[int], groups: ParallelGroups):
    """(layer index, this rank's state dict of it) for the ``wanted`` layers."""
    if checkpoint.pipeline:
        files = find_layer_files(checkpoint.directory)
        for layer in sorted(wanted & set(files.layers)):
            if files.tp_size == groups.tp_size:
                yield layer, torch.load(files.paths[layer][groups.tp_rank], map_location="cpu", weights_only=True)
            else:
                full_state = read_full_layer(files, layer, checkpoint.sharding)
                yield layer, _my_partition(checkpoint, layer, full_state, groups)
        return
    for layer, full_state in iter_full_layers(checkpoint):
        if layer in wanted:
            yield layer, _my_partition(checkpoint, layer, full_state, groups)


def load_stage_weights(stage: InferenceStage, checkpoint: SavedCheckpoint) -> None:
    """Copy this rank's weights of ``checkpoint`` into ``stage`` (cast to its dtype); every weight of
    the stage must be found (CheckpointInputError names the checkpoint and what is missing)."""
    prefixes = _module_prefixes(stage)
    state = {}
    for layer, layer_state in _stage_layers(checkpoint, set(prefixes), stage.groups):
        state.update({prefixes[layer] + name: tensor for name, tensor in layer_state.items()})
    expected = set(stage.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise CheckpointInputError(f"{checkpoint.directory} does not hold this model's weights: missing "
                                   f"{missing[:5]}, unexpected {unexpected[:5]}")
    stage.load_state_dict(state, strict=True)
