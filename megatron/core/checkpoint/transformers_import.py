"""A Hugging Face transformers GPT-2 or BLOOM model read back as our GPT's weights, one layer at a
time: the inverse of transformers_export.py (its docstring has the tensor names and layouts).

Configuration (config.json) -> our model options:

    GPT-2   n_layer, n_embd, n_head, n_inner (None: 4h), n_positions (learned positions, also the
            sequence length), layer_norm_epsilon, activation_function gelu_new or
            gelu_pytorch_tanh (tanh GeLU) or gelu (erf GeLU)
    BLOOM   n_layer, hidden_size, n_head, a 4h MLP, tanh GeLU, ALiBi, the embedding LayerNorm,
            layer_norm_epsilon, apply_residual_connection_post_layernorm

Refused by name: other model types, an output layer not tied to the word embeddings, GPT-2's
scale_attn_by_inverse_layer_idx, unscaled attention and cross-attention, and any weight the
mapping does not place (transformers' attention-mask buffers excepted).

Weights are read lazily: safetensors files (one, or shards with model.safetensors.index.json) are
memory-mapped and a tensor is read when its layer is written; a pytorch_model.bin is mapped too.
"""
import json
import os
from collections.abc import Iterator

import torch

from megatron.core.checkpoint.names import EMBEDDING_LAYER, FIRST_TRANSFORMER_LAYER, final_norm_layer
from megatron.core.checkpoint.reader import CheckpointInputError
from megatron.core.checkpoint.transformers_export import BLOOM, GPT2, GPT2_LAYER

TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# transformers' causal-mask buffers, saved by older GPT-2 versions; not weights.
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_transformers_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointInputError(f"--input_folder {directory} is not a transformers model: no config.json") from None
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointInputError(f"cannot read {path} ({type(error).__name__}: {error})") from None


def _gpt2_options(config: dict) -> tuple[dict, list[str]]:
    hidden = config["n_embd"]
    refused = []
    activation = config.get("activation_function", "gelu_new")
    if activation not in TANH_GELU + ("gelu",):
        refused.append(f"activation_function {activation}")
    for key, why in (("scale_attn_by_inverse_layer_idx", "scales attention by the layer index"),
                     ("add_cross_attention", "has cross-attention")):
        if config.get(key):
            refused.append(f"{key} ({why})")
    if not config.get("scale_attn_weights", True):
        refused.append("scale_attn_weights false (attention without 1/sqrt(head_dim))")
    options = {"num_layers": config["n_layer"], "hidden_size": hidden, "num_attention_heads": config["n_head"],
               "ffn_hidden_size": config.get("n_inner") or 4 * hidden, "max_position_embeddings": config["n_positions"],
               "layernorm_epsilon": config.get("layer_norm_epsilon", 1e-5), "position_embedding_type": "absolute",
               "embed_layernorm": False, "tanh_gelu": activation in TANH_GELU,
               "apply_residual_connection_post_layernorm": False}
    return options, refused


def _bloom_options(config: dict) -> tuple[dict, list[str]]:
    hidden = config.get("hidden_size", config.get("n_embed"))
    options = {"num_layers": config["n_layer"], "hidden_size": hidden, "num_attention_heads": config["n_head"],
               "ffn_hidden_size": 4 * hidden, "max_position_embeddings": None,
               "layernorm_epsilon": config.get("layer_norm_epsilon", 1e-5), "position_embedding_type": "alibi",
               "embed_layernorm": True, "tanh_gelu": True,
               "apply_residual_connection_post_layernorm": bool(config.get("apply_residual_connection_post_layernorm"))}
    return options, []


def model_options(config: dict, directory: str) -> tuple[str, dict]:
    """(GPT2 or BLOOM, our model options) of a transformers config.json (module docstring).

    The options: num_layers, hidden_size, num_attention_heads, ffn_hidden_size,
    max_position_embeddings (None for BLOOM: ALiBi has no position table), layernorm_epsilon,
    position_embedding_type, embed_layernorm, tanh_gelu, apply_residual_connection_post_layernorm,
    vocab_size (the model's rows, which may exceed its tokenizer's).
    """
    kind = config.get("model_type")
    if kind not in ("gpt2", "bloom"):
        raise CheckpointInputError(f"{directory}/config.json: model_type {kind!r} cannot be imported (GPT-2 and BLOOM "
                                   f"can: learned positions, or ALiBi with an embedding LayerNorm)")
    options, refused = (_gpt2_options if kind == "gpt2" else _bloom_options)(config)
    if not config.get("tie_word_embeddings", True):
        refused.append("tie_word_embeddings false (our output layer is the word embeddings)")
    if options["hidden_size"] % options["num_attention_heads"]:
        refused.append(f"a width {options['hidden_size']} that {options['num_attention_heads']} heads do not divide")
    if refused:
        raise CheckpointInputError(f"{directory}/config.json: cannot import a model with " + "; ".join(refused))
    return (GPT2 if kind == "gpt2" else BLOOM), {**options, "vocab_size": config["vocab_size"]}


class TransformersWeights:
    """The tensors of a transformers model directory by name, each read when asked for (module docstring)."""

    def __init__(self, directory: str):
        self.directory = directory
        self._files: dict[str, str] = {}  # tensor name -> file
        self._open: dict[str, object] = {}
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = os.path.join(directory, index_name)
            if os.path.isfile(index):
                with open(index) as f:
                    self._files = {name: os.path.join(directory, file) for name, file in json.load(f)["weight_map"].items()}
                break
        else:
            single = [os.path.join(directory, name) for name in ("model.safetensors", "pytorch_model.bin")
                      if os.path.isfile(os.path.join(directory, name))]
            if not single:
                raise CheckpointInputError(f"--input_folder {directory} holds no model.safetensors, "
                                           f"pytorch_model.bin or their index")
            self._files = {name: single[0] for name in self._handle(single[0]).keys()}
        for path in sorted(set(self._files.values())):
            self._handle(path)

    @property
    def names(self) -> set[str]:
        return set(self._files)

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (the first weight's by name), read from the file header."""
        name = min(name for name in self._files if not name.endswith(MASK_BUFFERS))
        path = self._files[name]
        if not path.endswith(".safetensors"):
            return self._handle(path)[name].dtype
        stored = self._handle(path).get_slice(name).get_dtype()
        if stored not in SAFETENSORS_DTYPES:
            raise CheckpointInputError(f"{path}: {name} is stored as {stored}; fp32, fp16 or bf16 weights import")
        return SAFETENSORS_DTYPES[stored]

    def _handle(self, path: str):
        """The open safetensors file, or the memory-mapped state dict of a .bin."""
        if path not in self._open:
            if not os.path.isfile(path):
                raise CheckpointInputError(f"{path} is missing (the index of {self.directory} names it)")
            try:
                if path.endswith(".safetensors"):
                    from safetensors import safe_open
                    self._open[path] = safe_open(path, framework="pt")
                else:
                    self._open[path] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as error:  # safetensors raises its own error types for a damaged header
                raise CheckpointInputError(f"cannot read {path} ({type(error).__name__}: {error})") from None
        return self._open[path]

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise CheckpointInputError(f"{self.directory}: the model has no tensor {name}")
        path = self._files[name]
        handle = self._handle(path)
        try:
            return handle.get_tensor(name) if path.endswith(".safetensors") else handle[name].clone()
        except Exception as error:  # a truncated file fails here, with safetensors' own error type
            raise CheckpointInputError(f"cannot read {name} from {path} ({type(error).__name__}: {error})") from None


def _per_head_qkv(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """GPT-2's c_attn (Conv1D [in, 3h] or bias [3h], ordered [3, heads, d]) -> ours [heads * 3 * d, (in)]."""
    rows = tensor.t() if tensor.dim() == 2 else tensor                  # [3h, (in)]
    grouped = rows.reshape(3, heads, -1, *rows.shape[1:])               # [3, heads, d, (in)]
    return grouped.transpose(0, 1).reshape(rows.shape).contiguous()     # [heads, 3, d, (in)] -> [3h, (in)]


class _Reader:
    """Takes tensors by name from the weights, remembering which were used."""

    def __init__(self, weights: TransformersWeights, prefix: str):
        self.weights, self.prefix, self.used = weights, prefix, set()

    def take(self, name: str) -> torch.Tensor:
        self.used.add(self.prefix + name)
        return self.weights.tensor(self.prefix + name)


def _transformer_layer(reader: _Reader, kind: str, index: int, heads: int) -> dict[str, torch.Tensor]:
    prefix = f"h.{index}."
    if kind == BLOOM:
        ours = ("input_layernorm", "self_attention.query_key_value", "self_attention.dense", "post_attention_layernorm",
                "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
        return {f"{module}.{p}": reader.take(f"{prefix}{module}.{p}") for module in ours for p in ("weight", "bias")}
    state = {}
    for module, theirs in GPT2_LAYER.items():
        for p in ("weight", "bias"):
            tensor = reader.take(f"{prefix}{theirs}.{p}")
            if module == "self_attention.query_key_value":
                tensor = _per_head_qkv(tensor, heads)
            elif p == "weight" and module in ("self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"):
                tensor = tensor.t().contiguous()  # Conv1D stores [in, out]
            state[f"{module}.{p}"] = tensor
    return state


def _embedding_layer(reader: _Reader, kind: str, padded_vocab_size: int) -> dict[str, torch.Tensor]:
    words = reader.take("wte.weight" if kind == GPT2 else "word_embeddings.weight")
    padding = words.new_zeros(padded_vocab_size - words.shape[0], words.shape[1])
    state = {"word_embeddings.weight": torch.cat([words, padding])}
    if kind == GPT2:
        state["position_embeddings.weight"] = reader.take("wpe.weight")
    else:
        state.update({f"embed_layernorm.{p}": reader.take(f"word_embeddings_layernorm.{p}") for p in ("weight", "bias")})
    return state


def _check_all_used(weights: TransformersWeights, reader: _Reader, kind: str) -> None:
    """Every tensor placed: an output head must be the word embeddings themselves (tied)."""
    left = sorted(name for name in weights.names - reader.used if not name.endswith(MASK_BUFFERS))
    if "lm_head.weight" in left:
        head = weights.tensor("lm_head.weight")
        words = weights.tensor(reader.prefix + ("wte.weight" if kind == GPT2 else "word_embeddings.weight"))
        if not torch.equal(head, words):
            raise CheckpointInputError(f"{weights.directory}: lm_head.weight differs from the word embeddings "
                                       f"(an untied output layer cannot be imported)")
        left.remove("lm_head.weight")
    if left:
        raise CheckpointInputError(f"{weights.directory}: tensors the import does not place: {', '.join(left[:5])}"
                                   + (f" and {len(left) - 5} more" if len(left) > 5 else ""))


def imported_layers(weights: TransformersWeights, kind: str, options: dict,
                    padded_vocab_size: int) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(pipeline layer index, its full state dict under our names), layer by layer, with the word
    embeddings padded by zero rows to ``padded_vocab_size``; then checks that nothing was left."""
    prefix = "transformer." if any(name.startswith("transformer.") for name in weights.names) else ""
    reader = _Reader(weights, prefix)
    yield EMBEDDING_LAYER, _embedding_layer(reader, kind, padded_vocab_size)
    for index in range(options["num_layers"]):
        yield FIRST_TRANSFORMER_LAYER + index, _transformer_layer(reader, kind, index, options["num_attention_heads"])
    yield final_norm_layer(options["num_layers"]), {p: reader.take(f"ln_f.{p}") for p in ("weight", "bias")}
    _check_all_used(weights, reader, kind)
