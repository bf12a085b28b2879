"""LayerNorm and RMSNorm against their formulas written out with torch's elementary operations."""
import pytest
import torch

from megatron.core.models.gpt.layer_norm import LayerNorm, RMSNorm, build_norm
from tests.core.models.gpt.gpt_test_utils import randomize_parameters, tiny_config


def test_layer_norm_formula():
    norm = LayerNorm(8, eps=1e-5)
    randomize_parameters(norm, seed=1, scale=0.5)
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(2)) * 3 + 1
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    expected = (x - mean) / torch.sqrt(var + 1e-5) * norm.weight + norm.bias
    torch.testing.assert_close(norm(x), expected)


def test_rms_norm_formula_and_gradients():
    norm = RMSNorm(8, eps=1e-6)
    randomize_parameters(norm, seed=1, scale=0.5)
    assert norm.bias is None and [name for name, _ in norm.named_parameters()] == ["weight"]
    x = (torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(2)) * 3 + 1).requires_grad_()
    x_copy = x.detach().clone().requires_grad_()
    expected = x_copy / torch.sqrt(x_copy.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    normed, residual = norm.norm_and_input(x)
    assert residual is x
    torch.testing.assert_close(normed, expected)
    (normed * torch.arange(8.0)).sum().backward()
    (expected * torch.arange(8.0)).sum().backward()
    torch.testing.assert_close(x.grad, x_copy.grad)


def test_rms_norm_matches_transformers_llama():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    theirs = llama.LlamaRMSNorm(16, eps=1e-5)
    ours = RMSNorm(16, eps=1e-5)
    randomize_parameters(ours, seed=3, scale=0.5)
    theirs.weight.data.copy_(ours.weight.data)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(ours(x), theirs(x))


def test_build_norm_follows_the_config():
    assert isinstance(build_norm(tiny_config()), LayerNorm)
    norm = build_norm(tiny_config(normalization="RMSNorm", layernorm_epsilon=1e-6, sequence_parallel=True))
    assert isinstance(norm, RMSNorm) and norm.eps == 1e-6 and norm.weight.sequence_parallel
