"""ParallelTransformerLayer: the pre-LN residual structure, written out with the layer's own sublayers."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt.transformer_layer import ParallelTransformerLayer
from megatron.core.parallel_state import single_rank_groups
from tests.core.models.gpt.gpt_test_utils import randomize_parameters, tiny_config


@pytest.mark.parametrize("post_layernorm_residual", [False, True])
def test_residual_structure(post_layernorm_residual):
    config = tiny_config(apply_residual_connection_post_layernorm=post_layernorm_residual)
    layer = ParallelTransformerLayer(config, 2, single_rank_groups()).eval()
    randomize_parameters(layer, seed=3, scale=0.3)
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(4))
    position_ids = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        output = layer(x, position_ids)
        normed = F.layer_norm(x, (32,), layer.input_layernorm.weight, layer.input_layernorm.bias, 1e-5)
        attention, bias = layer.self_attention(normed, position_ids)
        middle = (normed if post_layernorm_residual else x) + attention + bias
        normed = F.layer_norm(middle, (32,), layer.post_attention_layernorm.weight,
                              layer.post_attention_layernorm.bias, 1e-5)
        mlp, bias = layer.mlp(normed)
        expected = (normed if post_layernorm_residual else middle) + mlp + bias
    torch.testing.assert_close(output, expected)


def test_hidden_dropout_in_training():
    layer = ParallelTransformerLayer(tiny_config(hidden_dropout=0.5), 1, single_rank_groups())
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(5))
    position_ids = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        evaluated = layer.eval()(x, position_ids)
        trained = layer.train()(x, position_ids)
    assert not torch.allclose(evaluated, trained)


def test_fp32_residual_stream_with_bf16_parameters():
    config = tiny_config(params_dtype=torch.bfloat16, fp32_residual_connection=True)
    layer = ParallelTransformerLayer(config, 1, single_rank_groups())
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(6))
    output = layer(x, torch.arange(16).expand(2, 16))
    assert output.dtype == torch.float32 and layer.mlp.dense_h_to_4h.weight.dtype == torch.bfloat16
    plain = ParallelTransformerLayer(tiny_config(params_dtype=torch.bfloat16), 1, single_rank_groups())
    assert plain(x.to(torch.bfloat16), torch.arange(16).expand(2, 16)).dtype == torch.bfloat16
