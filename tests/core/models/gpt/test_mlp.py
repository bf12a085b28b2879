"""ParallelMLP (TP = 1) against the activation formulas written out directly."""
import math

import pytest
import torch

from megatron.core.models.gpt.mlp import ParallelMLP
from megatron.core.parallel_state import single_rank_groups
from tests.core.models.gpt.gpt_test_utils import randomize_parameters, tiny_config


def gelu_tanh(t):
    return 0.5 * t * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (t + 0.044715 * t ** 3)))


def gelu_erf(t):
    return 0.5 * t * (1.0 + torch.erf(t / math.sqrt(2.0)))


GATES = {
    "geglu": gelu_erf,
    "liglu": lambda t: t,
    "reglu": lambda t: t.clamp_min(0.0),
    "swiglu": lambda t: t / (1.0 + torch.exp(-t)),
}


def run(**overrides):
    module = ParallelMLP(tiny_config(ffn_hidden_size=24, **overrides), 1, single_rank_groups())
    randomize_parameters(module, seed=3, scale=0.5)
    x = torch.randn(5, 2, 32, generator=torch.Generator().manual_seed(4))
    output, bias = module(x)
    with torch.no_grad():
        hidden = x.double() @ module.dense_h_to_4h.weight.double().t() + module.dense_h_to_4h.bias.double()
    return module, (output + bias).detach().double(), hidden


def project_out(module, activated):
    return activated @ module.dense_4h_to_h.weight.detach().double().t() + module.dense_4h_to_h.bias.detach().double()


@pytest.mark.parametrize("overrides, activation", [
    (dict(), gelu_tanh),  # Megatron-DeepSpeed's default: fused bias + tanh GeLU
    (dict(bias_gelu_fusion=False), gelu_erf),
    (dict(bias_gelu_fusion=False, openai_gelu=True), gelu_tanh),
])
def test_gelu_variants(overrides, activation):
    module, output, hidden = run(**overrides)
    assert module.dense_h_to_4h.weight.shape == (24, 32)
    torch.testing.assert_close(output, project_out(module, activation(hidden)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("glu", sorted(GATES))
def test_glu_variants(glu):
    module, output, hidden = run(glu_activation=glu, bias_gelu_fusion=False)
    assert module.dense_h_to_4h.weight.shape == (48, 32)  # [W_a; W_g]
    linear, gate = hidden[..., :24], hidden[..., 24:]
    torch.testing.assert_close(output, project_out(module, linear * GATES[glu](gate)), rtol=1e-5, atol=1e-5)


def test_gelu_differs_from_erf():
    _, tanh_output, _ = run()
    _, erf_output, _ = run(bias_gelu_fusion=False)
    assert not torch.allclose(tanh_output, erf_output, rtol=0, atol=1e-6)
