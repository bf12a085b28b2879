"""Model FLOPs of a GPT: the matmul work of one training iteration, counted from the shapes alone.

Each multiply-add counts 2 FLOPs. Per token, one transformer layer's forward pass costs
4hp + 4hk (QKV 2h(p + 2k), attention output projection 2hp) + 4sp (scores and scores x values over
s keys) + 2hf(g + 1) (the MLP; g = 2 with a GLU, whose first matmul is twice as wide), with p =
heads x kv channels (h by default), k = key/value groups x kv channels (p by default; smaller with
grouped-query attention) and f the FFN width (4h by default); the output layer, tied or not, costs
2hV. The backward pass is twice the forward, so an iteration of B sequences costs
F = 3·B·s·[L·(4hp + 4hk + 4sp + 2hf(g + 1)) + 2hV], Megatron-LM's count. Activation recomputation is
not model work and is not counted (it is hardware work).

This module imports nothing, so sizing tools run without torch.
"""


def layer_forward_flops_per_token(hidden_size: int, seq_length: int, ffn_hidden_size: int | None = None,
                                  projection_size: int | None = None, glu: bool = False,
                                  key_value_size: int | None = None) -> int:
    """4hp + 4hk + 4sp + 2hf(g + 1): one transformer layer's forward FLOPs per token (module docstring)."""
    h, s = hidden_size, seq_length
    f = 4 * h if ffn_hidden_size is None else ffn_hidden_size
    p = h if projection_size is None else projection_size
    k = p if key_value_size is None else key_value_size
    gate = 2 if glu else 1
    return 4 * h * p + 4 * h * k + 4 * s * p + 2 * h * f * (gate + 1)


def output_layer_forward_flops_per_token(hidden_size: int, padded_vocab_size: int) -> int:
    """2hV: the output layer's (logits') forward FLOPs per token."""
    return 2 * hidden_size * padded_vocab_size


def model_flops_per_iteration(*, global_batch_size: int, seq_length: int, num_layers: int, hidden_size: int,
                              padded_vocab_size: int, ffn_hidden_size: int | None = None,
                              projection_size: int | None = None, glu: bool = False,
                              key_value_size: int | None = None) -> float:
    """F = 3·B·s·[L·(4hp + 4hk + 4sp + 2hf(g + 1)) + 2hV]: forward + backward matmul FLOPs of one iteration.

    ``ffn_hidden_size`` defaults to 4h, ``projection_size`` (heads x kv channels) to h,
    ``key_value_size`` (key/value groups x kv channels) to the projection size; ``glu`` doubles the
    first MLP matmul (g = 2).
    """
    per_layer = layer_forward_flops_per_token(hidden_size, seq_length, ffn_hidden_size, projection_size, glu,
                                              key_value_size)
    per_token = num_layers * per_layer + output_layer_forward_flops_per_token(hidden_size, padded_vocab_size)
    return 3.0 * global_batch_size * seq_length * per_token
