"""GPTModelConfig: derived defaults and Megatron-DeepSpeed's cross-checks, with errors naming the flags."""
import dataclasses

import pytest
import torch

from megatron.core.models.gpt.config import GPTConfigError, GPTModelConfig
from megatron.core.parallel_state import ParallelConfigError

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=8, padded_vocab_size=128, seq_length=32,
            max_position_embeddings=32)


def make(**overrides):
    return GPTModelConfig(**{**BASE, **overrides})


def test_derived_defaults():
    config = make()
    assert config.ffn_hidden_size == 4 * 64
    assert config.kv_channels == 8
    assert config.projection_size == 64
    assert config.softmax_in_fp32  # query-key layer scaling forces fp32 softmax
    assert not make(apply_query_key_layer_scaling=False).softmax_in_fp32
    assert make(kv_channels=16).projection_size == 128


@pytest.mark.parametrize("overrides, flags", [
    (dict(max_position_embeddings=16), ["--max-position-embeddings", "--seq-length"]),
    (dict(max_position_embeddings=None), ["--max-position-embeddings"]),
    (dict(position_embedding_type="alibi", max_position_embeddings=None), ["--max-position-embeddings"]),
    (dict(position_embedding_type="rotary", max_position_embeddings=16), ["--max-position-embeddings"]),
    (dict(position_embedding_type="rotary", rotary_percent=0.0), ["--rotary-percent"]),
    (dict(position_embedding_type="rotary", rotary_percent=0.375), ["--kv-channels", "--rotary-percent"]),
    (dict(position_embedding_type="rotary", use_rope_scaling=True, rope_scaling_low_freq_factor=4.0),
     ["--rope-scaling-low-freq-factor", "--rope-scaling-high-freq-factor"]),
    (dict(num_query_groups=3), ["--num-attention-heads", "--num-query-groups"]),
    (dict(normalization="ScaleNorm"), ["--normalization"]),
    (dict(position_embedding_type="learned"), ["--position-embedding-type"]),
    (dict(glu_activation="swiglu"), ["--glu-activation", "--no-bias-gelu-fusion"]),
    (dict(glu_activation="swish", bias_gelu_fusion=False), ["--glu-activation"]),
    (dict(num_attention_heads=6), ["--hidden-size", "--num-attention-heads", "--kv-channels"]),
    (dict(hidden_dropout=1.0), ["--hidden-dropout"]),
    (dict(attention_dropout=-0.1), ["--attention-dropout"]),
    (dict(checkpoint_num_layers=0), ["--checkpoint-num-layers"]),
    (dict(distribute_checkpointed_activations=True), ["--distribute-checkpointed-activations"]),
    (dict(num_layers=0), ["--num-layers"]),
    (dict(params_dtype=torch.float64), ["--fp16", "--bf16"]),
    (dict(position_embedding_type="rotary", max_position_embeddings=None, kv_channels=7), ["--kv-channels"]),
])
def test_invalid_configs_name_the_flags(overrides, flags):
    with pytest.raises(GPTConfigError) as error:
        make(**overrides)
    for flag in flags:
        assert flag in str(error.value)


def test_valid_position_types():
    assert make(position_embedding_type="rotary", max_position_embeddings=None).max_position_embeddings is None
    assert make(position_embedding_type="alibi", max_position_embeddings=64).max_position_embeddings == 64
    assert make(glu_activation="geglu", bias_gelu_fusion=False).glu_activation == "geglu"


def test_tensor_parallel_divisibility():
    config = make(ffn_hidden_size=100, padded_vocab_size=136)
    config.validate_for_tensor_parallel(4)
    with pytest.raises(ParallelConfigError, match="--num-attention-heads.*--tensor-model-parallel-size"):
        make(num_attention_heads=4, kv_channels=16).validate_for_tensor_parallel(8)
    with pytest.raises(ParallelConfigError, match="--ffn-hidden-size"):
        config.validate_for_tensor_parallel(8)  # 8 heads split evenly, 100 ffn units do not
    with pytest.raises(ParallelConfigError, match="vocabulary"):
        make(padded_vocab_size=130).validate_for_tensor_parallel(4)


def test_grouped_query_attention_sizes():
    config = make(num_query_groups=2)
    assert (config.queries_per_group, config.query_key_value_size) == (4, (8 + 2 * 2) * 8)
    assert make().num_query_groups == 8 and make().query_key_value_size == 3 * 64
    config.validate_for_tensor_parallel(2)
    with pytest.raises(GPTConfigError, match="--num-query-groups \\(2\\) must be divisible by "
                                             "--tensor-model-parallel-size \\(4\\)"):
        config.validate_for_tensor_parallel(4)


def test_bias_switches():
    assert make().qkv_bias and not make(add_bias_linear=False).qkv_bias
    assert make(add_bias_linear=False, add_qkv_bias=True).qkv_bias


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        make().num_layers = 3
