"""How each parameter of a saved GPT model is spread over the tensor-parallel ranks, read from the model.

The tensor-parallel layers mark every parameter they split with ``tensor_model_parallel``,
``partition_dim`` and ``partition_stride`` (megatron.core.tensor_parallel.layers); a parameter
without the mark, or marked ``tensor_model_parallel = False``, is replicated. ``ModelSharding``
builds the model of a configuration once at TP = 1 with fake tensors (torch's FakeTensorMode:
shapes without storage, so no memory and no random draws, whatever the size) and keeps those marks
by parameter name, so a tool holding only checkpoint files learns the split of each saved tensor
from the model definition itself: a parameter added to a layer needs nothing here. The table split
by vocabulary rows is the weight of the VocabParallelEmbedding module.

Names: the plain module's (``layers.0.mlp.dense_h_to_4h.weight``), the pipeline module's
(``3.mlp.dense_h_to_4h.weight``) or a layer file's key with its layer index, under our names or
Megatron-DeepSpeed's (names.py).
"""
import dataclasses
import functools

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron.core.checkpoint.names import (EMBEDDING_LAYER, PIPELINE_EMBEDDING_PREFIX, ParameterNameError, own_name,
                                           plain_name)
from megatron.core.checkpoint.partitions import TensorSplit
from megatron.core.dtypes import torch_dtype
from megatron.core.models.gpt.config import GPTModelConfig
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import single_rank_groups
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

PLAIN_PREFIXES = ("embedding.", "layers.", "final_layernorm.", "output_layer.")
# Settings that change how the model computes, not which parameters it has or how they are split;
# under CPU initialization the layers need no RNG tracker stream (the full weights they draw are fake).
# FP8 (delayed scaling's amax histories and scales, buffers beside the weights) is no part of a
# checkpoint's weights: the tools read and write the weights only (``is_fp8_state``).
NO_FP8 = dict(fp8=None, num_layers_at_start_in_bf16=0, num_layers_at_end_in_bf16=0)
FP8_STATE_MARKER = "fp8_gemms."
STRUCTURE_ONLY = dict(**NO_FP8, params_dtype=torch.float32, use_cpu_initialization=True, bias_gelu_fusion=False,
                      sequence_parallel=False, tp_comm_overlap=False, checkpoint_activations=False,
                      distribute_checkpointed_activations=False, hidden_dropout=0.0, attention_dropout=0.0)


def is_fp8_state(key: str) -> bool:
    """Whether a state-dict key is a linear layer's FP8 scaling state (``fp8_gemms.*``), not a weight."""
    return key.startswith(FP8_STATE_MARKER) or f".{FP8_STATE_MARKER}" in key


def parameter_split(parameter: torch.Tensor, vocabulary: bool = False) -> TensorSplit:
    """The split a tensor-parallel layer marked on ``parameter`` (module docstring)."""
    if not getattr(parameter, "tensor_model_parallel", False):
        return TensorSplit(None)
    return TensorSplit(parameter.partition_dim, parameter.partition_stride, vocabulary)


def module_splits(module: nn.Module) -> dict[str, TensorSplit]:
    """Every parameter of ``module`` by its name in ``module``, with its split."""
    vocabulary = {f"{name}.weight" if name else "weight" for name, child in module.named_modules()
                  if isinstance(child, VocabParallelEmbedding)}
    return {name: parameter_split(parameter, name in vocabulary) for name, parameter in module.named_parameters()}


def saved_model_config(saved: dict, **overrides) -> GPTModelConfig:
    """A checkpoint's model configuration (``args.model``, plain values) as a GPTModelConfig, with
    ``overrides``; fields it lacks take their defaults."""
    names = {field.name for field in dataclasses.fields(GPTModelConfig)}
    values = {name: value for name, value in saved.items() if name in names}
    if "params_dtype" in values:
        values["params_dtype"] = torch_dtype(str(values["params_dtype"]).removeprefix("torch."),
                                             "args.model.params_dtype")
    return GPTModelConfig(**{**values, **overrides})


class ModelSharding:
    """The split of every parameter of one GPT model (module docstring)."""

    def __init__(self, config: GPTModelConfig):
        structure = dataclasses.replace(config, **STRUCTURE_ONLY)
        self.num_layers = config.num_layers
        with FakeTensorMode():
            self.splits = module_splits(GPTModel(structure, single_rank_groups(), device="meta"))

    @classmethod
    def of_saved(cls, saved: dict) -> "ModelSharding":
        """The sharding of a checkpoint's model (``args.model``); a rotary model has no position table."""
        rotary = saved.get("position_embedding_type") == "rotary"
        return cls(saved_model_config(saved, **({"max_position_embeddings": None} if rotary else {})))

    def split(self, name: str) -> TensorSplit:
        """The split of parameter ``name``, a plain or a pipeline module's name (ours or Megatron-DeepSpeed's)."""
        ours = own_name(name)
        plain = ours if ours.startswith(PLAIN_PREFIXES) else plain_name(ours, self.num_layers)
        if plain not in self.splits:
            raise ParameterNameError(f"{name} is not a parameter of this {self.num_layers}-layer GPT model")
        return self.splits[plain]

    def layer_split(self, layer: int, key: str) -> TensorSplit:
        """The split of ``key`` of pipeline layer ``layer``'s state dict (a layer file's key)."""
        return self.split(PIPELINE_EMBEDDING_PREFIX + key if layer == EMBEDDING_LAYER else f"{layer}.{key}")

    def layer_splits(self, layer: int, keys) -> dict[str, TensorSplit]:
        return {key: self.layer_split(layer, key) for key in keys}


@functools.lru_cache(maxsize=8)
def model_sharding(config: GPTModelConfig) -> ModelSharding:
    """``ModelSharding(config)``, built once per configuration (a trainer asks at every save)."""
    return ModelSharding(config)
