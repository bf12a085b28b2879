"""A saved checkpoint as one single-process GPTModel (TP = PP = 1), whatever layout saved it: the
model configuration it records, and its weights merged layer by layer (reader.py) under the plain
module's names (names.py). For tools and tests that run the whole model in one process."""
import torch

from megatron.core.checkpoint.names import EMBEDDING_LAYER, PIPELINE_EMBEDDING_PREFIX, plain_name
from megatron.core.checkpoint.reader import SavedCheckpoint, iter_full_layers
from megatron.core.checkpoint.sharding import NO_FP8, saved_model_config
from megatron.core.models.gpt.config import GPTModelConfig
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import single_rank_groups


def gpt_model_config(checkpoint: SavedCheckpoint, **overrides) -> GPTModelConfig:
    """The saved model configuration (``args.model``) as a GPTModelConfig, with ``overrides``; without
    FP8 (a training setting: the weights run in the model's precision here)."""
    return saved_model_config(checkpoint.model, **{**NO_FP8, **overrides})


def full_model_state(checkpoint: SavedCheckpoint) -> dict[str, torch.Tensor]:
    """Every weight, full (TP partitions merged), under GPTModel's names."""
    state = {}
    for layer, layer_state in iter_full_layers(checkpoint):
        for name, tensor in layer_state.items():
            pipeline = PIPELINE_EMBEDDING_PREFIX + name if layer == EMBEDDING_LAYER else f"{layer}.{name}"
            state[plain_name(pipeline, checkpoint.model["num_layers"])] = tensor
    return state


def load_gpt_model(checkpoint: SavedCheckpoint, **overrides) -> GPTModel:
    """The checkpoint's model in this process, in eval mode, dropout off unless ``overrides`` say otherwise."""
    config = gpt_model_config(checkpoint, **{"hidden_dropout": 0.0, "attention_dropout": 0.0, **overrides})
    model = GPTModel(config, single_rank_groups())
    model.load_state_dict(full_model_state(checkpoint), strict=True)
    return model.eval()
