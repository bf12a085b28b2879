"""The two names of each GPT parameter: the pipeline module's and the plain module's.

The pipeline engine (GPTModelPipe) names a parameter by its layer's index in the layer list, which
is Megatron-DeepSpeed's numbering and names the layer files; the plain engine (GPTModel, ZeRO
stage 2) by its attribute path. For L transformer layers:

    pipeline                                plain
    tied_modules.embed.<rest>               embedding.<rest>          layer 1 (file layer_01)
    <i + 3>.<rest>, i = 0 .. L - 1          layers.<i>.<rest>         transformer layer i + 1
    <L + 4>.<rest>                          final_layernorm.<rest>    final norm
    <L + 5>.<rest>                          output_layer.<rest>       untied output layer

Universal checkpoints always hold pipeline names, so either engine reads them. Megatron-DeepSpeed
names the parameters as we do except the embedding LayerNorm (--embed-layernorm), which it keeps
inside the word embedding: ``word_embeddings.norm.*`` there, ``embed_layernorm.*`` here (``own_name``).
"""
import re

EMBEDDING_LAYER = 1
FIRST_TRANSFORMER_LAYER = 3
PIPELINE_EMBEDDING_PREFIX = "tied_modules.embed."
_PLAIN_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_PIPELINE_LAYER = re.compile(r"^(\d+)\.(.+)$")
# Megatron-DeepSpeed's name -> ours, as prefixes of a layer's state-dict key.
NAME_PREFIXES = {"word_embeddings.norm.": "embed_layernorm."}


class ParameterNameError(ValueError):
    """A name that is not one of the GPT model's parameters."""


def final_norm_layer(num_layers: int) -> int:
    return num_layers + 4


def output_layer(num_layers: int) -> int:
    """The layer-list index of the untied output layer (--untie-embeddings-and-output-weights)."""
    return num_layers + 5


def transformer_layer(index: int) -> int:
    """The layer-list index of transformer layer ``index`` (0-based)."""
    return index + FIRST_TRANSFORMER_LAYER


def pipeline_name(plain_name: str, num_layers: int) -> str:
    """The pipeline module's name of the plain module's parameter ``plain_name``."""
    if plain_name.startswith("embedding."):
        return PIPELINE_EMBEDDING_PREFIX + plain_name[len("embedding."):]
    if plain_name.startswith("final_layernorm."):
        return f"{final_norm_layer(num_layers)}.{plain_name[len('final_layernorm.'):]}"
    if plain_name.startswith("output_layer."):
        return f"{output_layer(num_layers)}.{plain_name[len('output_layer.'):]}"
    match = _PLAIN_LAYER.match(plain_name)
    if match is None or int(match[1]) >= num_layers:
        raise ParameterNameError(f"{plain_name} is not a parameter of a {num_layers}-layer GPT model")
    return f"{transformer_layer(int(match[1]))}.{match[2]}"


def as_pipeline_name(name: str, num_layers: int) -> str:
    """``name`` of either engine under the pipeline module's naming."""
    if name.startswith(PIPELINE_EMBEDDING_PREFIX) or _PIPELINE_LAYER.match(name):
        return name
    return pipeline_name(name, num_layers)


def plain_name(pipeline_name_: str, num_layers: int) -> str:
    """The plain module's name of the pipeline module's parameter ``pipeline_name_``."""
    if pipeline_name_.startswith(PIPELINE_EMBEDDING_PREFIX):
        return "embedding." + pipeline_name_[len(PIPELINE_EMBEDDING_PREFIX):]
    match = _PIPELINE_LAYER.match(pipeline_name_)
    layer = int(match[1]) if match else -1
    if layer == final_norm_layer(num_layers):
        return f"final_layernorm.{match[2]}"
    if layer == output_layer(num_layers):
        return f"output_layer.{match[2]}"
    if not FIRST_TRANSFORMER_LAYER <= layer < transformer_layer(num_layers):
        raise ParameterNameError(f"{pipeline_name_} is not a parameter of a {num_layers}-layer GPT model")
    return f"layers.{layer - FIRST_TRANSFORMER_LAYER}.{match[2]}"


def own_name(name: str) -> str:
    """Our name of a parameter or state-dict key that Megatron-DeepSpeed names ``name`` (NAME_PREFIXES),
    anywhere in a dotted name."""
    for theirs, ours in NAME_PREFIXES.items():
        if name.startswith(theirs) or f".{theirs}" in name:
            return name.replace(theirs, ours, 1)
    return name
