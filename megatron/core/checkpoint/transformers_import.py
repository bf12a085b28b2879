"""A Hugging Face transformers GPT-2, BLOOM, Llama, Mistral or Qwen2 model read back as our GPT's
weights, one layer at a time: the inverse of transformers_export.py (its docstring has the tensor
names and layouts).

Configuration (config.json) -> our model options:

    GPT-2   n_layer, n_embd, n_head, n_inner (None: 4h), n_positions (learned positions, also the
            sequence length), layer_norm_epsilon, activation_function gelu_new or
            gelu_pytorch_tanh (tanh GeLU) or gelu (erf GeLU)
    BLOOM   n_layer, hidden_size, n_head, a 4h MLP, tanh GeLU, ALiBi, the embedding LayerNorm,
            layer_norm_epsilon, apply_residual_connection_post_layernorm
    Llama   num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads (the groups g),
    Mistral head_dim (kv channels), intermediate_size (SwiGLU; hidden_act silu), rms_norm_eps
    Qwen2   (RMSNorm), max_position_embeddings, rotary positions: rope_theta (the base),
            partial_rotary_factor, rope_scaling / rope_parameters of type default or llama3 (Llama
            3's factor, low and high frequency factors, original context), tie_word_embeddings
            (false: an untied output layer). Biases: none (Mistral; Llama without attention_bias
            and mlp_bias), on every linear layer (Llama with both), on q, k, v only (Qwen2).

Refused by name: other model types, GPT-2 and BLOOM with an untied output layer, GPT-2's
scale_attn_by_inverse_layer_idx, unscaled attention and cross-attention; for the Llama class
sliding-window attention over more positions than its window, mixture-of-experts layers, heads that
the key/value groups do not divide, rope scaling other than llama3, an activation other than SiLU,
Llama's attention_bias without mlp_bias (a bias on o_proj means biases on every linear layer here)
or the reverse; and any weight the mapping does not place (transformers' buffers excepted).

Weights are read lazily: safetensors files (one, or shards with model.safetensors.index.json) are
memory-mapped and a tensor is read when its layer is written; a pytorch_model.bin is mapped too.
"""
import json
import os
from collections.abc import Iterator

import torch

from megatron.core.checkpoint.names import EMBEDDING_LAYER, FIRST_TRANSFORMER_LAYER, final_norm_layer, output_layer
from megatron.core.checkpoint.reader import CheckpointInputError
from megatron.core.checkpoint.transformers_export import (BLOOM, GPT2, GPT2_LAYER, LLAMA, LLAMA_CLASS, MISTRAL,
                                                          QWEN2, llama_names)

TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# transformers' buffers saved by older versions (GPT-2's causal masks, Llama's rotary frequencies); not weights.
MASK_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
MODEL_TYPES = {"gpt2": GPT2, "bloom": BLOOM, "llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2}
# configuration keys of mixture-of-experts layers (Mixtral, Qwen2-MoE, DeepSeek)
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
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
               "embed_layernorm": False, "openai_gelu": activation in TANH_GELU,
               "bias_gelu_fusion": activation in TANH_GELU, "apply_residual_connection_post_layernorm": False}
    if not config.get("tie_word_embeddings", True):
        refused.append("tie_word_embeddings false (a GPT-2 imports with its output layer tied to the word embeddings)")
    return options, refused


def _bloom_options(config: dict) -> tuple[dict, list[str]]:
    hidden = config.get("hidden_size", config.get("n_embed"))
    options = {"num_layers": config["n_layer"], "hidden_size": hidden, "num_attention_heads": config["n_head"],
               "ffn_hidden_size": 4 * hidden, "max_position_embeddings": None,
               "layernorm_epsilon": config.get("layer_norm_epsilon", 1e-5), "position_embedding_type": "alibi",
               "embed_layernorm": True, "openai_gelu": True, "bias_gelu_fusion": True,
               "apply_residual_connection_post_layernorm": bool(config.get("apply_residual_connection_post_layernorm"))}
    refused = [] if config.get("tie_word_embeddings", True) else [
        "tie_word_embeddings false (a BLOOM imports with its output layer tied to the word embeddings)"]
    return options, refused


def _rope_options(config: dict) -> tuple[dict, list[str]]:
    """Rotary settings of transformers 4's rope_theta / rope_scaling or transformers 5's rope_parameters."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    options = {"position_embedding_type": "rotary", "rotary_base": float(rope.get("rope_theta", config.get(
        "rope_theta", 10000.0))), "rotary_percent": float(rope.get("partial_rotary_factor", config.get(
            "partial_rotary_factor", 1.0))), "use_rope_scaling": kind == "llama3"}
    if kind == "llama3":
        options.update(rope_scaling_factor=float(rope["factor"]), rope_scaling_low_freq_factor=float(
            rope["low_freq_factor"]), rope_scaling_high_freq_factor=float(rope["high_freq_factor"]),
            rope_scaling_original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    refused = [] if kind in SUPPORTED_ROPE_TYPES else [
        f"rope scaling type {kind!r} (only llama3 frequency scaling, or none, is implemented)"]
    return options, refused


def _sliding_window(config: dict, kind: str, context: int) -> tuple[int | None, list[str]]:
    """(the window if one applies, refusals): attention over at most ``window`` positions is full
    attention as long as no sequence is longer, so a window at least ``context`` imports."""
    window = None if kind == "qwen2" and not config.get("use_sliding_window") else config.get("sliding_window")
    other_layers = sorted(set(config.get("layer_types") or ()) - {"full_attention"})
    if window is None and other_layers:
        return None, [f"layer_types {', '.join(other_layers)} (only full attention is implemented)"]
    if window is not None and window < context:
        return window, [f"sliding_window {window} (sliding-window attention; only sequences of at most {window} "
                        f"positions attend the same without it: import with --seq_length {window} or less, not "
                        f"{context})"]
    return window, []


def _biases(config: dict, kind: str) -> tuple[dict, list[str]]:
    """add_bias_linear and add_qkv_bias of the model's projections (module docstring)."""
    if kind == "qwen2":
        return {"add_bias_linear": False, "add_qkv_bias": True}, []
    attention, mlp = bool(config.get("attention_bias")), bool(config.get("mlp_bias"))
    if attention != mlp:
        named = "attention_bias without mlp_bias" if attention else "mlp_bias without attention_bias"
        return {}, [f"{named} (biases on some linear layers only: here either every linear layer has one, "
                    f"or only q, k and v, as Qwen2)"]
    return {"add_bias_linear": attention, "add_qkv_bias": False}, []


def _llama_options(config: dict, kind: str, seq_length: int | None) -> tuple[dict, list[str]]:
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    refused = [f"{key} {config[key]} (mixture-of-experts layers)" for key in MOE_KEYS if config.get(key)]
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        refused.append(f"hidden_act {config['hidden_act']} (the gated MLP here is SwiGLU: silu)")
    if heads % groups:
        refused.append(f"num_attention_heads {heads} that num_key_value_heads {groups} do not divide")
    head_dim = config.get("head_dim") or (hidden // heads if hidden % heads == 0 else None)
    if head_dim is None:
        refused.append(f"a width {hidden} that {heads} heads do not divide and no head_dim")
    positions = config["max_position_embeddings"]
    window, window_refused = _sliding_window(config, kind, seq_length or positions)
    rope, rope_refused = _rope_options(config)
    biases, bias_refused = _biases(config, kind)
    options = {"num_layers": config["num_hidden_layers"], "hidden_size": hidden, "num_attention_heads": heads,
               "num_query_groups": groups, "kv_channels": head_dim, "ffn_hidden_size": config["intermediate_size"],
               "max_position_embeddings": min(positions, window or positions), "normalization": "RMSNorm",
               "layernorm_epsilon": config.get("rms_norm_eps", 1e-6), "glu_activation": "swiglu",
               "bias_gelu_fusion": False, "embed_layernorm": False, "apply_residual_connection_post_layernorm": False,
               "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
               **rope, **biases}
    return options, refused + window_refused + rope_refused + bias_refused


def model_options(config: dict, directory: str, seq_length: int | None = None) -> tuple[str, dict]:
    """(its architecture: GPT2, BLOOM, LLAMA, MISTRAL or QWEN2; our model options) of a transformers
    config.json (module docstring), for training sequences of ``seq_length`` (default: the model's
    max_position_embeddings).

    The options are GPTModelConfig fields (num_layers, hidden_size, ..., max_position_embeddings
    None for BLOOM: ALiBi has no position table), and vocab_size (the model's rows, which may
    exceed its tokenizer's).
    """
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
        experts = " (mixture-of-experts layers)" if any(config.get(key) for key in MOE_KEYS) else ""
        raise CheckpointInputError(f"{directory}/config.json: model_type {kind!r}{experts} cannot be imported "
                                   f"(these can: {', '.join(MODEL_TYPES)})")
    try:
        if kind in ("gpt2", "bloom"):
            options, refused = (_gpt2_options if kind == "gpt2" else _bloom_options)(config)
            if options["hidden_size"] % options["num_attention_heads"]:
                refused.append(f"a width {options['hidden_size']} that {options['num_attention_heads']} heads "
                               f"do not divide")
        else:
            options, refused = _llama_options(config, kind, seq_length)
    except KeyError as error:
        raise CheckpointInputError(f"{directory}/config.json: {kind} configuration without {error}") from None
    if refused:
        raise CheckpointInputError(f"{directory}/config.json: cannot import a model with " + "; ".join(refused))
    return MODEL_TYPES[kind], {**options, "vocab_size": config["vocab_size"]}


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
    """Takes tensors by name from the weights (under ``prefix`` unless told otherwise), remembering which were used."""

    def __init__(self, weights: TransformersWeights, prefix: str):
        self.weights, self.prefix, self.used = weights, prefix, set()

    def take(self, name: str, prefixed: bool = True) -> torch.Tensor:
        name = self.prefix + name if prefixed else name
        self.used.add(name)
        return self.weights.tensor(name)


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


def grouped_query_key_value(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            groups: int) -> torch.Tensor:
    """q_proj [n hn, (h)], k_proj and v_proj [g hn, (h)] -> our rows [g, q + 2, hn] flattened: each
    key/value group's q = n / g query heads, then its key head, then its value head."""
    rest = query.shape[1:]
    parts = [tensor.reshape(groups, -1, *rest) for tensor in (query, key, value)]
    return torch.cat(parts, dim=1).reshape(-1, *rest).contiguous()


def _llama_layer(reader: _Reader, index: int, options: dict) -> dict[str, torch.Tensor]:
    """One decoder layer of the Llama class under our names (transformers_export.llama_names)."""
    theirs = llama_names(index)

    def take(module: str, p: str) -> torch.Tensor:
        return reader.take(f"{theirs[module]}.{p}")

    def query_key_value(p: str) -> torch.Tensor:
        query, key, value = (reader.take(f"{name}.{p}") for name in theirs["self_attention.query_key_value"])
        return grouped_query_key_value(query, key, value, options["num_query_groups"])

    def up_and_gate(p: str) -> torch.Tensor:  # our first MLP projection is [a; g] with y = a * silu(g)
        return torch.cat([reader.take(f"{name}.{p}") for name in theirs["mlp.dense_h_to_4h"]])

    state = {"input_layernorm.weight": take("input_layernorm", "weight"),
             "post_attention_layernorm.weight": take("post_attention_layernorm", "weight"),
             "self_attention.query_key_value.weight": query_key_value("weight"),
             "self_attention.dense.weight": take("self_attention.dense", "weight"),
             "mlp.dense_h_to_4h.weight": up_and_gate("weight"),
             "mlp.dense_4h_to_h.weight": take("mlp.dense_4h_to_h", "weight")}
    if options["add_bias_linear"] or options["add_qkv_bias"]:
        state["self_attention.query_key_value.bias"] = query_key_value("bias")
    if options["add_bias_linear"]:
        state.update({"self_attention.dense.bias": take("self_attention.dense", "bias"),
                      "mlp.dense_h_to_4h.bias": up_and_gate("bias"),
                      "mlp.dense_4h_to_h.bias": take("mlp.dense_4h_to_h", "bias")})
    return state


def _word_embeddings_name(kind: str) -> str:
    return {GPT2: "wte.weight", BLOOM: "word_embeddings.weight"}.get(kind, "embed_tokens.weight")


def _padded(rows: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    return torch.cat([rows, rows.new_zeros(padded_vocab_size - rows.shape[0], rows.shape[1])])


def _embedding_layer(reader: _Reader, kind: str, padded_vocab_size: int) -> dict[str, torch.Tensor]:
    state = {"word_embeddings.weight": _padded(reader.take(_word_embeddings_name(kind)), padded_vocab_size)}
    if kind == GPT2:
        state["position_embeddings.weight"] = reader.take("wpe.weight")
    elif kind == BLOOM:
        state.update({f"embed_layernorm.{p}": reader.take(f"word_embeddings_layernorm.{p}") for p in ("weight", "bias")})
    return state


def _check_all_used(weights: TransformersWeights, reader: _Reader, kind: str) -> None:
    """Every tensor placed: a tied output head must be the word embeddings themselves."""
    left = sorted(name for name in weights.names - reader.used if not name.endswith(MASK_BUFFERS))
    if "lm_head.weight" in left:
        head = weights.tensor("lm_head.weight")
        if not torch.equal(head, weights.tensor(reader.prefix + _word_embeddings_name(kind))):
            raise CheckpointInputError(f"{weights.directory}: lm_head.weight differs from the word embeddings, and "
                                       f"config.json ties them (tie_word_embeddings)")
        left.remove("lm_head.weight")
    if left:
        raise CheckpointInputError(f"{weights.directory}: tensors the import does not place: {', '.join(left[:5])}"
                                   + (f" and {len(left) - 5} more" if len(left) > 5 else ""))


def _prefix(weights: TransformersWeights, kind: str) -> str:
    wanted = "model." if kind in LLAMA_CLASS else "transformer."
    return wanted if any(name.startswith(wanted) for name in weights.names) else ""


def imported_layers(weights: TransformersWeights, kind: str, options: dict,
                    padded_vocab_size: int) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(pipeline layer index, its full state dict under our names), layer by layer, with the word
    embeddings (and an untied output layer) padded by zero rows to ``padded_vocab_size``; then checks
    that nothing was left."""
    reader = _Reader(weights, _prefix(weights, kind))
    llama = kind in LLAMA_CLASS
    yield EMBEDDING_LAYER, _embedding_layer(reader, kind, padded_vocab_size)
    for index in range(options["num_layers"]):
        state = (_llama_layer(reader, index, options) if llama
                 else _transformer_layer(reader, kind, index, options["num_attention_heads"]))
        yield FIRST_TRANSFORMER_LAYER + index, state
    final_norm = final_norm_layer(options["num_layers"])
    if llama:
        yield final_norm, {"weight": reader.take("norm.weight")}
    else:
        yield final_norm, {p: reader.take(f"ln_f.{p}") for p in ("weight", "bias")}
    if options.get("untie_embeddings_and_output_weights"):
        yield output_layer(options["num_layers"]), {
            "weight": _padded(reader.take("lm_head.weight", prefixed=False), padded_vocab_size)}
    _check_all_used(weights, reader, kind)
