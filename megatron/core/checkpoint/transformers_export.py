"""Our GPT's weights as a Hugging Face transformers model: GPT-2, BLOOM, Llama or Qwen2.

Which architecture expresses the model:

    GPT2LMHeadModel    learned absolute positions, no embedding LayerNorm
    BloomForCausalLM   ALiBi, an embedding LayerNorm, MLP width 4h, tanh GeLU
    LlamaForCausalLM   RMSNorm, SwiGLU, rotary positions on whole heads (any base, Llama 3's
                       scaling), any key/value groups and head size, tied or untied output layer,
                       biases on no linear layer or on all of them
    Qwen2ForCausalLM   the same with biases on the query/key/value projection only (--add-qkv-bias)

GPT-2 and BLOOM have pre-LayerNorm blocks, biases everywhere, a tied output head; all four scale
attention by 1/sqrt(head_dim) (Megatron's query-key layer scaling divides and multiplies by the
layer number, which cancels). A model takes the Llama class as soon as it has one of its options
(RMSNorm, a GLU, rotary positions, key/value groups, an untied head, missing biases); what the
chosen architecture cannot express is refused by name: e.g. LayerNorm or a GeLU MLP with rotary
positions, ALiBi with RMSNorm, --rotary-percent below 1, --apply-residual-connection-post-layernorm,
a kv-channels other than h / heads for GPT-2 and BLOOM.

Tensors, per transformer layer (ours [out, in] like torch.nn.Linear):

    ours                          GPT-2 (Conv1D: [in, out])         BLOOM (Linear)
    input_layernorm               h.i.ln_1                          h.i.input_layernorm
    self_attention.query_key_value h.i.attn.c_attn  (reordered)      h.i.self_attention.query_key_value
    self_attention.dense          h.i.attn.c_proj  (transposed)     h.i.self_attention.dense
    post_attention_layernorm      h.i.ln_2                          h.i.post_attention_layernorm
    mlp.dense_h_to_4h             h.i.mlp.c_fc     (transposed)     h.i.mlp.dense_h_to_4h
    mlp.dense_4h_to_h             h.i.mlp.c_proj   (transposed)     h.i.mlp.dense_4h_to_h

Our fused QKV rows are ordered per head, [heads, 3, head_dim], as BLOOM's are; GPT-2's c_attn
columns are [3, heads, head_dim] (all queries, then keys, then values). The word embeddings lose
the vocabulary padding: the exported vocabulary is the tokenizer's.

The Llama class (under ``model.``; ``llama_names``), ours -> theirs:

    input_layernorm, post_attention_layernorm    layers.i.input_layernorm, .post_attention_layernorm
    self_attention.query_key_value               layers.i.self_attn.q_proj, k_proj, v_proj: our rows
                                                 are [g, q + 2, hn] (per key/value group its q = n / g
                                                 query heads, its key, its value)
    self_attention.dense                         layers.i.self_attn.o_proj
    mlp.dense_h_to_4h = [a; g]                   layers.i.mlp.up_proj (a), gate_proj (g): a * silu(g)
    mlp.dense_4h_to_h                            layers.i.mlp.down_proj
    embedding word_embeddings, final norm        embed_tokens, norm
    output_layer (untied)                        lm_head (top level)

Rotary embeddings rotate the two halves of each head in both (rotate_half), so no permutation.
"""
import torch

from megatron.core.checkpoint.names import EMBEDDING_LAYER, FIRST_TRANSFORMER_LAYER, final_norm_layer, output_layer

GPT2, BLOOM = "GPT2LMHeadModel", "BloomForCausalLM"
LLAMA, MISTRAL, QWEN2 = "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"
LLAMA_CLASS = (LLAMA, MISTRAL, QWEN2)


class NotExportableError(ValueError):
    """The model has options that the chosen transformers architecture cannot express."""


def llama_names(index: int) -> dict[str, str | tuple[str, ...]]:
    """Our module -> the Llama class's (under ``model.``) in decoder layer ``index`` (module docstring)."""
    layer = f"layers.{index}."
    return {"input_layernorm": layer + "input_layernorm",
            "post_attention_layernorm": layer + "post_attention_layernorm",
            "self_attention.query_key_value": tuple(f"{layer}self_attn.{x}_proj" for x in "qkv"),
            "self_attention.dense": layer + "self_attn.o_proj",
            "mlp.dense_h_to_4h": (layer + "mlp.up_proj", layer + "mlp.gate_proj"),
            "mlp.dense_4h_to_h": layer + "mlp.down_proj"}


def _is_llama_class(model: dict) -> bool:
    groups = model.get("num_query_groups")
    return (model.get("normalization", "LayerNorm") != "LayerNorm" or bool(model.get("glu_activation"))
            or model["position_embedding_type"] == "rotary" or groups not in (None, model["num_attention_heads"])
            or bool(model.get("untie_embeddings_and_output_weights")) or not model.get("add_bias_linear", True)
            or bool(model.get("add_qkv_bias")))


def _llama_architecture(model: dict) -> str:
    """LLAMA or QWEN2 for a model with an option of the Llama class, else NotExportableError naming
    what neither expresses."""
    refused = []
    if model.get("normalization", "LayerNorm") != "RMSNorm":
        refused.append(f"--normalization {model.get('normalization', 'LayerNorm')}")
    if model.get("glu_activation") != "swiglu":
        refused.append(f"--glu-activation {model['glu_activation']}" if model.get("glu_activation")
                       else "a GeLU MLP (no --swiglu)")
    if model["position_embedding_type"] != "rotary":
        refused.append(f"--position-embedding-type {model['position_embedding_type']}")
    elif model.get("rotary_percent", 1.0) != 1.0:
        refused.append(f"--rotary-percent {model['rotary_percent']} (Llama rotates whole heads)")
    for flag in ("embed_layernorm", "apply_residual_connection_post_layernorm"):
        if model.get(flag):
            refused.append("--" + flag.replace("_", "-"))
    if model.get("add_bias_linear", True) and model.get("add_qkv_bias"):
        refused.append("--add-qkv-bias with biases on every linear layer")
    if refused:
        raise NotExportableError("no transformers architecture here expresses " + "; ".join(refused) +
                                 " with the Llama-class options of this model (Llama and Qwen2: RMSNorm, SwiGLU, "
                                 "rotary positions)")
    return QWEN2 if model.get("add_qkv_bias") else LLAMA


def architecture(model: dict) -> str:
    """GPT2, BLOOM, LLAMA or QWEN2 for the saved model configuration ``model`` (module docstring)."""
    if _is_llama_class(model):
        return _llama_architecture(model)
    refused = []
    if model.get("apply_residual_connection_post_layernorm"):
        refused.append("--apply-residual-connection-post-layernorm")
    if model["kv_channels"] * model["num_attention_heads"] != model["hidden_size"]:
        refused.append(f"--kv-channels {model['kv_channels']}")
    kind = model["position_embedding_type"]
    if kind == "absolute" and model.get("embed_layernorm"):
        refused.append("--embed-layernorm with learned absolute positions")
    if kind == "alibi":
        if not model.get("embed_layernorm"):
            refused.append("ALiBi without --embed-layernorm (BLOOM has an embedding LayerNorm)")
        if model["ffn_hidden_size"] != 4 * model["hidden_size"]:
            refused.append(f"--ffn-hidden-size {model['ffn_hidden_size']} (BLOOM's MLP is 4h)")
        if not (model.get("bias_gelu_fusion") or model.get("openai_gelu")):
            refused.append("the exact erf GeLU (--no-bias-gelu-fusion; BLOOM's GeLU is the tanh approximation)")
    if kind not in ("absolute", "alibi"):
        refused.append(f"--position-embedding-type {kind}")
    if refused:
        raise NotExportableError("no transformers architecture here expresses " + "; ".join(refused) +
                                 " (GPT-2: learned positions; BLOOM: ALiBi with an embedding LayerNorm)")
    return GPT2 if kind == "absolute" else BLOOM


def _llama_config(model: dict, vocab_size: int, dtype: torch.dtype) -> dict:
    kind = architecture(model)
    bias = bool(model.get("add_bias_linear", True))
    rope_scaling = None
    if model.get("use_rope_scaling"):
        rope_scaling = {"rope_type": "llama3", "factor": model["rope_scaling_factor"],
                        "low_freq_factor": model["rope_scaling_low_freq_factor"],
                        "high_freq_factor": model["rope_scaling_high_freq_factor"],
                        "original_max_position_embeddings": model["rope_scaling_original_max_position_embeddings"]}
    config = {"architectures": [kind], "model_type": "qwen2" if kind == QWEN2 else "llama", "vocab_size": vocab_size,
              "hidden_size": model["hidden_size"], "intermediate_size": model["ffn_hidden_size"],
              "num_hidden_layers": model["num_layers"], "num_attention_heads": model["num_attention_heads"],
              "num_key_value_heads": model.get("num_query_groups") or model["num_attention_heads"],
              "head_dim": model["kv_channels"], "hidden_act": "silu",
              "max_position_embeddings": model.get("max_position_embeddings") or model["seq_length"],
              "rms_norm_eps": model["layernorm_epsilon"], "rope_theta": model.get("rotary_base", 10000.0),
              "rope_scaling": rope_scaling, "tie_word_embeddings": not model.get("untie_embeddings_and_output_weights"),
              "attention_dropout": 0.0, "torch_dtype": str(dtype).removeprefix("torch.")}
    if kind == QWEN2:
        return {**config, "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": model["num_layers"]}
    return {**config, "attention_bias": bias, "mlp_bias": bias}


def transformers_config(model: dict, vocab_size: int, dtype: torch.dtype) -> dict:
    """config.json of the exported model."""
    if architecture(model) in LLAMA_CLASS:
        return _llama_config(model, vocab_size, dtype)
    common = {"vocab_size": vocab_size, "n_layer": model["num_layers"], "n_head": model["num_attention_heads"],
              "layer_norm_epsilon": model["layernorm_epsilon"], "torch_dtype": str(dtype).removeprefix("torch."),
              "tie_word_embeddings": True, "architectures": [architecture(model)]}
    if architecture(model) == GPT2:
        tanh = model.get("bias_gelu_fusion") or model.get("openai_gelu")
        return {**common, "model_type": "gpt2", "n_embd": model["hidden_size"],
                "n_positions": model["max_position_embeddings"], "n_inner": model["ffn_hidden_size"],
                "activation_function": "gelu_new" if tanh else "gelu", "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                "attn_pdrop": 0.0, "scale_attn_weights": True}
    return {**common, "model_type": "bloom", "hidden_size": model["hidden_size"],
            "apply_residual_connection_post_layernorm": False, "hidden_dropout": 0.0, "attention_dropout": 0.0}


def _gpt2_qkv(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Ours [heads * 3 * d, ...] (per head) -> GPT-2's [3 * heads * d, ...], then Conv1D's [in, out]."""
    grouped = tensor.reshape(heads, 3, -1, *tensor.shape[1:])          # [heads, 3, d, (h)]
    reordered = grouped.transpose(0, 1).reshape(tensor.shape)           # [3, heads, d, (h)] -> [3h, (h)]
    return reordered.t() if reordered.dim() == 2 else reordered


GPT2_LAYER = {"input_layernorm": "ln_1", "self_attention.query_key_value": "attn.c_attn",
              "self_attention.dense": "attn.c_proj", "post_attention_layernorm": "ln_2",
              "mlp.dense_h_to_4h": "mlp.c_fc", "mlp.dense_4h_to_h": "mlp.c_proj"}


def split_query_key_value(tensor: torch.Tensor, model: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our rows [g, q + 2, hn] flattened, (h) -> q_proj [n hn, (h)], k_proj and v_proj [g hn, (h)]."""
    heads, head_dim = model["num_attention_heads"], model["kv_channels"]
    groups = model.get("num_query_groups") or heads
    grouped = tensor.reshape(groups, -1, *tensor.shape[1:])
    query, key, value = grouped.split([heads // groups * head_dim, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *tensor.shape[1:]).contiguous() for t in (query, key, value))


def _llama_layer(model: dict, layer: int, state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    if layer == EMBEDDING_LAYER:
        return {"model.embed_tokens.weight": state["word_embeddings.weight"][:vocab_size]}
    if layer == final_norm_layer(model["num_layers"]):
        return {"model.norm.weight": state["weight"]}
    if layer == output_layer(model["num_layers"]):
        return {"lm_head.weight": state["weight"][:vocab_size]}
    theirs = llama_names(layer - FIRST_TRANSFORMER_LAYER)
    out = {}
    for name, tensor in state.items():
        module, _, kind = name.rpartition(".")
        if module == "self_attention.query_key_value":
            parts = split_query_key_value(tensor, model)
        elif module == "mlp.dense_h_to_4h":
            parts = tensor.chunk(2)  # [up; gate]
        else:
            parts = (tensor,)
        names = theirs[module] if isinstance(theirs[module], tuple) else (theirs[module],)
        out.update({f"model.{theirs_name}.{kind}": part.contiguous() for theirs_name, part in zip(names, parts)})
    return out


def exported_layer(model: dict, layer: int, state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """The transformers tensors of our pipeline layer ``layer`` (full tensors, names.py numbering)."""
    if architecture(model) in LLAMA_CLASS:
        return _llama_layer(model, layer, state, vocab_size)
    gpt2 = architecture(model) == GPT2
    if layer == EMBEDDING_LAYER:
        out = {"transformer.wte.weight" if gpt2 else "transformer.word_embeddings.weight":
               state["word_embeddings.weight"][:vocab_size]}
        if gpt2:
            out["transformer.wpe.weight"] = state["position_embeddings.weight"]
        else:
            out.update({f"transformer.word_embeddings_layernorm.{p}": state[f"embed_layernorm.{p}"]
                        for p in ("weight", "bias")})
        return out
    if layer == final_norm_layer(model["num_layers"]):
        return {f"transformer.ln_f.{p}": state[p] for p in ("weight", "bias")}
    prefix = f"transformer.h.{layer - FIRST_TRANSFORMER_LAYER}."
    if not gpt2:
        return {prefix + name: tensor for name, tensor in state.items()}
    out = {}
    for name, tensor in state.items():
        module, _, kind = name.rpartition(".")
        if module == "self_attention.query_key_value":
            tensor = _gpt2_qkv(tensor, model["num_attention_heads"])
        elif kind == "weight" and module in ("self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"):
            tensor = tensor.t()  # Conv1D stores [in, out]
        out[f"{prefix}{GPT2_LAYER[module]}.{kind}"] = tensor.contiguous()
    return out
