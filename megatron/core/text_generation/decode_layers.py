"""Transformer layers' steps over a key/value cache, computed from the training layers' own weights.

A step feeds the new positions of each sequence (a prompt, then one token at a time) and attends
over the cached keys and values of the earlier ones (kv_cache.py), so each layer computes what
ParallelTransformerLayer.forward computes for those positions of the whole sequence:

    x' = r_1 + Attn_cache(LN_1(x)),  y = ParallelTransformerLayer.mlp_block(x')

in eval mode (no dropout). Attention stores the step's keys and values in the cache, then runs
sdpa over the cached ones (ParallelSelfAttention.sdpa); one query over a fixed-size cache goes
through ``fused_kernels.decode_attention``, which stores the key and value itself and reads only
the filled positions. One token of one sequence over a fixed-size cache (a batch-1 decoding step,
bound by reading the weights) runs the whole layer in five ops where ``fuses_one_row_steps``
allows (see ``one_row_step``).
"""
import math

import torch

from megatron.core import fused_kernels
from megatron.core.models.gpt.attention import ParallelSelfAttention, merge_heads
from megatron.core.models.gpt.config import GPTModelConfig
from megatron.core.models.gpt.positional import alibi_bias
from megatron.core.models.gpt.transformer_layer import ParallelTransformerLayer


def fuses_one_row_steps(config: GPTModelConfig, tp_size: int) -> bool:
    """Whether ``one_row_step`` covers the layers of this model: a GeLU or SwiGLU MLP, no second
    residual source, no fp32 residuals and no TP all-reduce (between a product and its bias)."""
    return (tp_size == 1 and not config.sequence_parallel and config.glu_activation in (None, "swiglu")
            and not config.apply_residual_connection_post_layernorm and not config.fp32_residual_connection)


def cached_attention(attention: ParallelSelfAttention, mixed: torch.Tensor, position_ids: torch.Tensor, kv_cache,
                     mixed_bias: torch.Tensor | None = None) -> torch.Tensor:
    """ParallelSelfAttention.attend over a cache: query_key_value's output [s, b, np * 3 * hn] of the
    step's positions -> the heads' outputs [s, b, np * hn]; the step's keys and values are stored.

    ``kv_cache.extend(key, value)`` returns the keys and values to attend over [b, np, T, hn], a mask
    [.., s, T] (True = hidden) and the queries' positions [s], or None for both (then the queries
    are the last s of the T positions). One query over a fixed-size cache goes to ``step_attention``.
    ``mixed_bias``: the projection's bias, already in mixed (split_query_key_value's contract)."""
    if kv_cache.fixed_size and mixed.shape[0] == 1:
        return merge_heads(step_attention(attention, mixed, position_ids, kv_cache))
    seq_length = mixed.shape[0]
    query, key, value = attention.heads(mixed, position_ids, mixed_bias)  # [b, np, s, hn]
    key, value, mask, query_positions = kv_cache.extend(key, value)  # [b, np, T, hn]
    alibi = None
    if attention.config.position_embedding_type == "alibi":
        alibi = alibi_bias(attention.alibi_slopes, seq_length, key.shape[-2], query_positions).to(query.dtype)
    return merge_heads(attention.sdpa(query, key, value, alibi, mask))


def step_attention(attention: ParallelSelfAttention, mixed: torch.Tensor, position_ids: torch.Tensor,
                   kv_cache) -> torch.Tensor:
    """One token per row over a fixed-size cache, in one ``fused_kernels.decode_attention``: the query,
    key and value are read where the projection's output mixed [1, b, g * (q + 2) * hn] (its bias
    included) holds them, and the rotary embedding, the cache write and the attention happen in the
    kernel. -> [b, np, 1, hn]."""
    queries, head_dim = attention.config.queries_per_group, attention.head_dim
    grouped = mixed.reshape(1, mixed.shape[1], -1, queries + 2, head_dim).permute(1, 2, 3, 0, 4)  # [b, g, q + 2, 1, hn]
    query, key, value = grouped[:, :, :queries], grouped[:, :, queries], grouped[:, :, queries + 1]
    keys, values, position = kv_cache.buffers(key)
    embedding = attention.config.position_embedding_type
    slopes = attention.alibi_slopes if embedding == "alibi" else None
    rotary = (attention.rotary_frequencies(mixed.device), position_ids.reshape(-1)) if embedding == "rotary" else None
    return fused_kernels.decode_attention(query, keys, values, position, slopes, 1.0 / math.sqrt(head_dim), key, value,
                                          rotary)


def layer_step(layer: ParallelTransformerLayer, hidden_states: torch.Tensor, position_ids: torch.Tensor,
               kv_cache, fuse_one_row: bool = False) -> torch.Tensor:
    """The layer over the step's positions: hidden_states [s, b, h], position_ids [b, s] -> [s, b, h];
    ``fuse_one_row`` (fuses_one_row_steps of the model) lets one token of one sequence over a
    fixed-size cache take ``one_row_step``."""
    if fuse_one_row and kv_cache.fixed_size and hidden_states.shape[:2] == (1, 1):
        return one_row_step(layer, hidden_states, position_ids, kv_cache)
    attention = layer.self_attention
    normed, residual = layer.norm_and_residual(layer.input_layernorm, hidden_states)
    mixed, _ = attention.query_key_value(normed, bias_grad_by_caller=True)
    context = cached_attention(attention, mixed, position_ids, kv_cache, attention.query_key_value.bias)
    attention_output, attention_bias = attention.dense(context)
    return layer.mlp_block(layer.bias_dropout_add(attention_output, attention_bias, residual))


def one_row_step(layer: ParallelTransformerLayer, hidden_states: torch.Tensor, position_ids: torch.Tensor,
                 kv_cache) -> torch.Tensor:
    """``layer_step`` for one token of one sequence over a fixed-size cache, in five ops (each one
    kernel on a GPU, a GEMV with its neighbours folded in, see fused_kernels.layer_norm_linear):

        qkv = LN_1(x) W_qkv^T + b_qkv;  x' = x + (Attn(qkv) W_o^T + b_o)   (attention stores k, v)
        y = x' + (act(LN_2(x') W_1^T + b_1) W_2^T + b_2)

    LN is LayerNorm or RMSNorm, act GeLU or SwiGLU (a * silu(g) of the [W_a; W_g] product); absent
    biases are skipped.
    [1, 1, h] -> [1, 1, h]. A batch-1 step is bound by reading the weights; separate layer-norm and
    add kernels between the GEMVs cost a launch and a ramp each."""
    attention, mlp = layer.self_attention, layer.mlp
    first, second = layer.input_layernorm, layer.post_attention_layernorm
    norm = "rms" if layer.config.normalization == "RMSNorm" else "layer"
    activation = "swiglu" if layer.config.glu_activation == "swiglu" else mlp.gelu_form
    mixed = fused_kernels.layer_norm_linear(hidden_states, first.weight, first.bias, first.eps,
                                            attention.query_key_value.weight, attention.query_key_value.bias,
                                            None, norm)
    context = cached_attention(attention, mixed, position_ids, kv_cache)  # [1, 1, np * hn]
    hidden_states = fused_kernels.linear(context, attention.dense.weight, attention.dense.bias, hidden_states)
    intermediate = fused_kernels.layer_norm_linear(hidden_states, second.weight, second.bias, second.eps,
                                                   mlp.dense_h_to_4h.weight, mlp.dense_h_to_4h.bias, activation, norm)
    return fused_kernels.linear(intermediate, mlp.dense_4h_to_h.weight, mlp.dense_4h_to_h.bias, hidden_states)
