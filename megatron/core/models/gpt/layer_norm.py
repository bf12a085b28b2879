"""LayerNorm as a module: parameters of the norm, computation in ``fused_kernels.layer_norm``."""
import torch
from torch import nn

from megatron.core import fused_kernels


class LayerNorm(nn.Module):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias over the last dim, statistics in fp32.

    Replicated on every TP rank (its input is). Runs the fused kernel on GPU, the reference on CPU.
    """

    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_kernels.layer_norm(x, self.weight, self.bias, self.eps)
