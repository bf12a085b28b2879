"""The normalizations as modules (LayerNorm, RMSNorm): their parameters; the computation is in
``fused_kernels.layer_norm`` and ``fused_kernels.rms_norm``."""
import torch
from torch import nn

from megatron.core import fused_kernels
from megatron.core.models.gpt.config import GPTModelConfig


class LayerNorm(nn.Module):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias over the last dim, statistics in fp32.

    Replicated on every TP rank. Runs the fused kernel on GPU, the reference on CPU. With
    ``sequence_parallel`` its input is one rank's block of the sequence, so the gradients of weight
    and bias are partial sums: they are marked for the TP all-reduce
    (``tensor_parallel.allreduce_sequence_parallel_gradients``).
    """

    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype = torch.float32, device=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=device))
        self.weight.sequence_parallel = self.bias.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_kernels.layer_norm(x, self.weight, self.bias, self.eps)

    def norm_and_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(LN(x), x) for a block whose residual branch is x: the fused backward adds that branch's
        gradient to x's in the norm's kernel instead of in a separate add."""
        return fused_kernels.layer_norm(x, self.weight, self.bias, self.eps, return_input=True)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim, the mean in fp32 (no bias: ``bias`` is None).

    Replicated on every TP rank, and marked for the TP all-reduce under ``sequence_parallel`` as
    LayerNorm. Runs ``fused_kernels.rms_norm``.
    """

    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype = torch.float32, device=None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device))
        self.register_parameter("bias", None)
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_kernels.rms_norm(x, self.weight, self.eps)

    def norm_and_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x), x), as LayerNorm.norm_and_input."""
        return fused_kernels.rms_norm(x, self.weight, self.eps, return_input=True)


def norm_class(config: GPTModelConfig) -> type[LayerNorm] | type[RMSNorm]:
    """The module of --normalization."""
    return RMSNorm if config.normalization == "RMSNorm" else LayerNorm


def build_norm(config: GPTModelConfig, device=None, sequence_parallel: bool | None = None) -> LayerNorm | RMSNorm:
    """The model's normalization (--normalization) over h, with its epsilon and params dtype;
    ``sequence_parallel`` defaults to the config's."""
    return norm_class(config)(config.hidden_size, config.layernorm_epsilon, config.params_dtype, device,
                              sequence_parallel=config.sequence_parallel if sequence_parallel is None
                              else sequence_parallel)
