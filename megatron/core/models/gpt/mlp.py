"""The transformer's MLP, h -> ffn -> h, with the ffn dimension split over the tensor-parallel ranks."""
import torch
import torch.nn.functional as F
from torch import nn

from megatron.core import fused_kernels
from megatron.core.models.gpt.config import GPTModelConfig
from megatron.core.models.gpt.init import weight_init_method
from megatron.core.parallel_state import ParallelGroups
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput, checkpoint


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


GLU_GATE_FUNCTIONS = {
    "geglu": F.gelu,
    "liglu": _identity,
    "reglu": F.relu,
}  # swiglu: fused_kernels.swiglu


class ParallelMLP(nn.Module):
    """y = act(x W1^T + b1) W2^T + b2, or with a GLU: [a | g] = x W1^T + b1, y = (a * act(g)) W2^T + b2.

    W1 (``dense_h_to_4h``) is column-parallel: rank r computes ffn / tp of the hidden units, no
    communication. W2 (``dense_4h_to_h``) is row-parallel: partial products are all-reduced, and its
    bias is returned unadded for the fused bias-dropout-add.

    act: the tanh approximation of GeLU fused with the bias (default, Megatron-DeepSpeed's bias-GeLU fusion),
    exact erf GeLU with --no-bias-gelu-fusion, tanh GeLU with --openai-gelu. GLU variants (geglu:
    erf GeLU, liglu: identity, reglu: ReLU, swiglu: SiLU) gate one half of a 2 ffn-wide W1 with the
    other. W1 is then split with stride 2: the full weight is [W_a; W_g] and rank r holds
    [W_a,r; W_g,r], so every rank gates its own units and the result does not depend on the TP degree
    (Megatron-DeepSpeed's per-rank [a | g] checkpoint layout). Without biases (--disable-bias-linear)
    b1 and b2 are absent (the returned bias is None).
    """

    def __init__(self, config: GPTModelConfig, layer_number: int, groups: ParallelGroups, device=None):
        super().__init__()
        self.config = config
        self.recompute_modules = config.recompute_modules  # selective recompute's (limit_selective_recompute)
        gated = config.glu_activation is not None
        common = dict(tp_group=groups.tp, use_cpu_initialization=config.use_cpu_initialization,
                      params_dtype=config.params_dtype, device=device,
                      sequence_parallel=config.sequence_parallel,
                      comm_overlap=config.tp_comm_overlap, fp8=config.fp8_for_layer(layer_number),
                      skip_bias_add=True, bias=config.add_bias_linear)
        self.dense_h_to_4h = ColumnParallelLinear(
            config.hidden_size, (2 if gated else 1) * config.ffn_hidden_size, gather_output=False,
            stride=2 if gated else 1,
            init_method=weight_init_method(config, layer_number, "mlp.dense_h_to_4h.weight"), **common)
        # GeLU's form: the tanh approximation (the fused bias-GeLU, --openai-gelu) or the exact erf one,
        # by the names of fused_kernels.layer_norm_linear
        self.gelu_form = "gelu_tanh" if config.bias_gelu_fusion or config.openai_gelu else "gelu"
        self.dense_4h_to_h = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, input_is_parallel=True,
            init_method=weight_init_method(config, layer_number, "mlp.dense_4h_to_h.weight", output_projection=True),
            **common)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[s, b, h] -> (output [s, b, h], bias [h]).

        Selective recompute (``recompute_modules``): "mlp" keeps only the input and recomputes
        the whole MLP in backward; "mlp_act" keeps no copy of the activation's output [s, b, ffn / tp]:
        dense_4h_to_h's backward recomputes it (elementwise, from the kept first-layer output)."""
        if "mlp" in self.recompute_modules and torch.is_grad_enabled():
            output = checkpoint(self._output, False, hidden_states)
            return output, self.dense_4h_to_h.bias
        return self._projections(hidden_states)

    def _output(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._projections(hidden_states)[0]

    def _projections(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        intermediate, bias = self.dense_h_to_4h(hidden_states)  # [s, b, (2) ffn / tp]
        if "mlp_act" not in self.recompute_modules:
            return self.dense_4h_to_h(self.activation(intermediate, bias))
        recompute = CheckpointWithoutOutput()
        activated = recompute.checkpoint(self.activation, intermediate, bias)
        with recompute.consumers():
            return self.dense_4h_to_h(activated)

    def activation(self, intermediate: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The first layer's output and bias [s, b, (2) ffn / tp] -> the activation [s, b, ffn / tp]."""
        if self.config.bias_gelu_fusion and bias is not None and self.config.glu_activation is None:
            return fused_kernels.bias_gelu(bias, intermediate)
        if bias is not None:
            intermediate = intermediate + bias
        if self.config.glu_activation == "swiglu":
            intermediate = fused_kernels.swiglu(intermediate)  # [s, b, ffn / tp]
        elif self.config.glu_activation is not None:
            linear, gate = intermediate.chunk(2, dim=-1)  # 2 x [s, b, ffn / tp]
            intermediate = linear * GLU_GATE_FUNCTIONS[self.config.glu_activation](gate)
        else:
            intermediate = F.gelu(intermediate, approximate="tanh" if self.gelu_form == "gelu_tanh" else "none")
        return intermediate
