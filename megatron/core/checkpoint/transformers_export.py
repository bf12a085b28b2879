"""Our GPT's weights as a Hugging Face transformers model: GPT-2 or BLOOM.

Which architecture expresses the model:

    GPT2LMHeadModel    learned absolute positions, no embedding LayerNorm
    BloomForCausalLM   ALiBi, an embedding LayerNorm, MLP width 4h, tanh GeLU

Both have pre-LayerNorm blocks, biases everywhere, a tied output head and 1/sqrt(head_dim)
attention scaling (Megatron's query-key layer scaling divides and multiplies by the layer number,
which cancels). Options neither can express are refused by name: rotary positions, a GLU MLP,
--apply-residual-connection-post-layernorm, a kv-channels other than h / heads.

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
"""
import torch

from megatron.core.checkpoint.names import EMBEDDING_LAYER, FIRST_TRANSFORMER_LAYER, final_norm_layer

GPT2, BLOOM = "GPT2LMHeadModel", "BloomForCausalLM"


class NotExportableError(ValueError):
    """The model has options that the chosen transformers architecture cannot express."""


def architecture(model: dict) -> str:
    """GPT2 or BLOOM for the saved model configuration ``model`` (module docstring)."""
    refused = []
    if model.get("glu_activation"):
        refused.append(f"--glu-activation {model['glu_activation']}")
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


def transformers_config(model: dict, vocab_size: int, dtype: torch.dtype) -> dict:
    """config.json of the exported model."""
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


def exported_layer(model: dict, layer: int, state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """The transformers tensors of our pipeline layer ``layer`` (full tensors, names.py numbering)."""
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
