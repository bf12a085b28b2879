"""ParallelTransformerLayer: the pre-LN residual structure, written out with the layer's own sublayers."""
import pytest
import torch
import torch.nn.functional as F

from megatron.core.models.gpt.masks import get_ltor_masks_and_position_ids
from megatron.core.models.gpt.transformer_layer import ParallelTransformerLayer, interleave_steps, run_layers_overlapped
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


class _RecordedWork:
    """A launched collective that logs when it is waited for."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait(self):
        self.log.append(("wait", self.name))


def _recorded_steps(chunk: str, log: list, num_layers: int):
    """A chunk's steps as ParallelTransformerLayer.forward_steps yields them: a launched all-reduce
    after the attention and after the MLP of each layer."""
    for number in range(num_layers):
        for part in ("attention", "mlp"):
            log.append(("launch", f"{chunk}.{number}.{part}"))
            yield [_RecordedWork(f"{chunk}.{number}.{part}", log)]
    return chunk


def test_each_chunks_collective_is_waited_for_after_the_other_chunk_has_run():
    log = []
    assert interleave_steps([_recorded_steps("c0", log, 2), _recorded_steps("c1", log, 2)]) == ["c0", "c1"]
    steps = ["0.attention", "0.mlp", "1.attention", "1.mlp"]
    expected = [("launch", f"c0.{steps[0]}"), ("launch", f"c1.{steps[0]}")]
    for previous, step in zip(steps, steps[1:]):
        expected += [("wait", f"c0.{previous}"), ("launch", f"c0.{step}"),
                     ("wait", f"c1.{previous}"), ("launch", f"c1.{step}")]
    expected += [("wait", f"c0.{steps[-1]}"), ("wait", f"c1.{steps[-1]}")]
    assert log == expected


@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("overrides", [dict(position_embedding_type="rotary"),
                                       dict(position_embedding_type="alibi", attention_impl="materialized")])
def test_layers_run_on_chunks_equal_the_layers_on_the_whole_batch(chunks, overrides):
    """Each chunk takes its own samples' positions and masks (documents reset at different places)."""
    config = tiny_config(**overrides)
    layers = [ParallelTransformerLayer(config, number, single_rank_groups()) for number in (1, 2)]
    for number, layer in enumerate(layers):
        randomize_parameters(layer, seed=10 + number, scale=0.3)
    tokens = torch.randint(1, 64, (4, 16), generator=torch.Generator().manual_seed(6))
    for row, end_of_document in enumerate((3, 7, 11, 14)):
        tokens[row, end_of_document] = 0
    masks = get_ltor_masks_and_position_ids(tokens, 0, True, True, True)
    x = torch.randn(16, 4, 32, generator=torch.Generator().manual_seed(7), requires_grad=True)
    whole = x
    for layer in layers:
        whole = layer(whole, masks.position_ids, masks.attention_mask)
    chunked = run_layers_overlapped(layers, x, masks.position_ids, masks.attention_mask, chunks)
    torch.testing.assert_close(chunked, whole)
    gradient = torch.randn_like(whole)
    whole_grad, = torch.autograd.grad(whole, x, gradient)
    chunked_grad, = torch.autograd.grad(chunked, x, gradient)
    torch.testing.assert_close(chunked_grad, whole_grad)


def test_chunks_must_divide_the_micro_batch():
    layer = ParallelTransformerLayer(tiny_config(), 1, single_rank_groups())
    with pytest.raises(ValueError, match="--tp-comm-overlap-chunks 2 .* micro-batch \\(3 samples\\)"):
        run_layers_overlapped([layer], torch.zeros(16, 3, 32), torch.arange(16).expand(3, 16), None, 2)
