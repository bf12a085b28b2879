"""LayerNorm against the formula written out with torch's elementary operations."""
import torch

from megatron.core.models.gpt.layer_norm import LayerNorm
from tests.core.models.gpt.gpt_test_utils import randomize_parameters


def test_layer_norm_formula():
    norm = LayerNorm(8, eps=1e-5)
    randomize_parameters(norm, seed=1, scale=0.5)
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(2)) * 3 + 1
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    expected = (x - mean) / torch.sqrt(var + 1e-5) * norm.weight + norm.bias
    torch.testing.assert_close(norm(x), expected)
