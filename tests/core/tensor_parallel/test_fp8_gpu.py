"""The FP8 linear layer's GEMMs through torch._scaled_mm on a GPU against the CPU emulation's
definition (the same quantized operands, dequantized around an fp32 matmul), per recipe and format."""
import functools

import pytest
import torch

from megatron.core.tensor_parallel import fp8
from megatron.core.tensor_parallel.fp8_linear import end_fp8_step
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                 reason="needs a Hopper GPU")]


@pytest.mark.parametrize("fp8_format", fp8.FP8_FORMATS)
@pytest.mark.parametrize("recipe", fp8.FP8_RECIPES)
def test_scaled_mm_layer_equals_the_emulation(recipe, fp8_format):
    torch.manual_seed(0)
    init = functools.partial(torch.nn.init.normal_, mean=0.0, std=0.02)
    layers = {emulate: ColumnParallelLinear(256, 384, tp_group=None, init_method=init, use_cpu_initialization=True,
                                            params_dtype=torch.bfloat16, device="cuda",
                                            fp8=fp8.Fp8Config(format=fp8_format, recipe=recipe, emulate=emulate))
              for emulate in (False, True)}
    layers[True].load_state_dict(layers[False].state_dict())
    x = torch.randn(64, 2, 256, device="cuda", dtype=torch.bfloat16)
    grad_y = torch.randn(64, 2, 384, device="cuda", dtype=torch.bfloat16) * 1e-3
    results = {}
    for emulate, layer in layers.items():
        for step in range(2):  # delayed: the second step quantizes with the first's amaxes
            layer.zero_grad()
            leaf = x.clone().requires_grad_(True)
            y, _ = layer(leaf)
            y.backward(grad_y)
            end_fp8_step(layer, [None])
        results[emulate] = (y.detach(), leaf.grad, layer.weight.grad)
    for found, expected in zip(results[False], results[True]):
        assert found.dtype == expected.dtype == torch.bfloat16
        torch.testing.assert_close(found.float(), expected.float(), rtol=2 ** -7,
                                   atol=2 ** -7 * expected.float().abs().max().item())
