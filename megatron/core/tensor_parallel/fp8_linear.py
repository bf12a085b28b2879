"""The three GEMMs of one parallel linear layer in FP8 (fp8.py has the formats, scales and recipes).

For X [m, k] (the tokens of a micro-batch, gathered under sequence parallelism), this rank's
weight W [n, k] and the output gradient dY [m, n]:

    forward      Y  = X W^T     a = q(X),     b = q(W)
    backward     dX = dY W      a = q(dY),    b = q(W^T)
                 dW = dY^T X    a = q(dY^T),  b = q(X^T)

(``fp8.scaled_mm`` computes a b^T). Per tensor (tensorwise, delayed) each operand is quantized once
and the backward operands are the transposed FP8 data, so forward keeps q(X) and q(W) for the
backward (one byte per element) instead of X and W; per row (rowwise) the transposed operands are
quantized from X^T and W^T themselves (each row's scale is over the GEMM's contraction), so X and W
are kept.

Tensor parallelism: an amax taken over a tensor that the TP group splits is max-reduced over the
group before its scale is made, so every rank quantizes with the scale of the whole tensor and TP = t
computes what TP = 1 does. ``parallel_dim`` says what the group splits: "output" (column-parallel:
W's rows and dY's columns), "input" (row-parallel: W's and X's columns) or None (one rank). Per
tensor: W's amax always, X's under "input", dY's under "output". Per row: the amaxes of the GEMM
whose contraction is split (the forward's over k under "input", dX's over n under "output"); dW's
contraction (the tokens) is never split. Delayed scaling takes its scales from the layer's history
(``fp8.DelayedScaling``), whose amaxes the trainer reduces over every rank when the step ends, and
records each operand's amax here.
"""
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from megatron.core.parallel_state import group_size
from megatron.core.tensor_parallel.fp8 import (DelayedScaling, Fp8Config, Fp8Operand, absolute_max, quantize,
                                               quantize_operand, scaled_mm, transposed)
from megatron.core.tensor_parallel.utils import all_reduce_max

PARALLEL_DIMS = (None, "input", "output")


@dataclass
class Fp8ForwardState:
    """What forward keeps for the backward GEMMs: q(X) and q(W) per tensor, or X and W per row."""

    x: torch.Tensor | Fp8Operand
    weight: torch.Tensor | Fp8Operand


class Fp8Gemms(torch.nn.Module):
    """A linear layer's FP8 GEMMs and scaling state (module docstring); the layer calls ``output``
    in its autograd forward and ``grad_input`` / ``grad_weight`` in its backward, with 2-d views."""

    def __init__(self, config: Fp8Config, parallel_dim: str | None, tp_group: ProcessGroup | None,
                 device: torch.device | str | None = None):
        super().__init__()
        if parallel_dim not in PARALLEL_DIMS:
            raise ValueError(f"Fp8Gemms: parallel_dim must be one of {PARALLEL_DIMS}, got {parallel_dim!r}")
        self.config = config
        self.parallel_dim = parallel_dim if group_size(tp_group) > 1 else None
        self.tp_group = tp_group
        self.delayed = DelayedScaling(config, device) if config.recipe == "delayed" else None

    @property
    def rowwise(self) -> bool:
        return self.config.recipe == "rowwise"

    def output(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, Fp8ForwardState]:
        """Y = X W^T for x [m, k], weight [n, k] -> (Y [m, n] in x's dtype, what backward needs)."""
        if self.rowwise:
            split = self.parallel_dim == "input"
            y = scaled_mm(self._rows(x, "input", split), self._rows(weight, "weight", split), x.dtype,
                          self.config.emulate)
            return y, Fp8ForwardState(x, weight)
        q_x = self._tensor(x, "input", split=self.parallel_dim == "input")
        q_weight = self._tensor(weight, "weight", split=self.parallel_dim is not None)
        return scaled_mm(q_x, q_weight, x.dtype, self.config.emulate), Fp8ForwardState(q_x, q_weight)

    def grad_operands(self, grad_output: torch.Tensor) -> tuple[Fp8Operand, Fp8Operand]:
        """dY [m, n] quantized for the two backward GEMMs: (q(dY) for dX, q(dY^T) for dW); per tensor
        one quantization, per row one over n and one over the tokens."""
        if self.rowwise:
            return (self._rows(grad_output, "grad_output", split=self.parallel_dim == "output"),
                    self._rows(grad_output.t(), "grad_output", split=False))
        q_grad = self._tensor(grad_output, "grad_output", split=self.parallel_dim == "output")
        return q_grad, transposed(q_grad)

    def grad_input(self, q_grad: Fp8Operand, state: Fp8ForwardState, dtype: torch.dtype) -> torch.Tensor:
        """dX = dY W [m, k] in ``dtype``, from ``grad_operands``' first."""
        if self.rowwise:
            q_weight_t = self._rows(state.weight.t(), "weight", split=self.parallel_dim == "output")
        else:
            q_weight_t = transposed(state.weight)
        return scaled_mm(q_grad, q_weight_t, dtype, self.config.emulate)

    def grad_weight(self, q_grad_t: Fp8Operand, state: Fp8ForwardState, dtype: torch.dtype) -> torch.Tensor:
        """dW = dY^T X [n, k] in ``dtype`` (fp32 to add into a main_grad), from ``grad_operands``' second."""
        q_x_t = self._rows(state.x.t(), "input", split=False) if self.rowwise else transposed(state.x)
        return scaled_mm(q_grad_t, q_x_t, dtype, self.config.emulate)

    def _tensor(self, x: torch.Tensor, role: str, split: bool) -> Fp8Operand:
        """x quantized per tensor: with the current amax (reduced over the group when ``split``), or
        with the delayed scale while its amax is recorded."""
        dtype = self.config.dtype(role)
        amax = absolute_max(x, rowwise=False)
        if self.delayed is not None:
            self.delayed.record(role, amax)
            scale = self.delayed.role_scale(role)
            return Fp8Operand(quantize(x, scale, dtype).contiguous(), scale)
        if split:
            amax = all_reduce_max(amax, self.tp_group)
        return quantize_operand(x, dtype, self.config.margin, rowwise=False, amax=amax)

    def _rows(self, x: torch.Tensor, role: str, split: bool) -> Fp8Operand:
        """x [r, c] quantized per row, the row amaxes reduced over the group when ``split`` (the
        contraction runs over the ranks' columns)."""
        amax = absolute_max(x, rowwise=True)
        if split:
            amax = all_reduce_max(amax, self.tp_group)
        return quantize_operand(x, self.config.dtype(role), self.config.margin, rowwise=True, amax=amax)


class _Fp8Matmul(torch.autograd.Function):
    """Y = X W^T + b for X [m, k] (2-d), W [n, k], with the three GEMMs of ``gemms``."""

    @staticmethod
    def forward(ctx, x, weight, bias, gemms):
        y, ctx.state = gemms.output(x, weight)
        ctx.gemms, ctx.weight = gemms, weight
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad_output):
        gemms, weight = ctx.gemms, ctx.weight
        q_grad, q_grad_t = gemms.grad_operands(grad_output)
        grad_input = gemms.grad_input(q_grad, ctx.state, grad_output.dtype)
        main_grad = getattr(weight, "main_grad", None)
        grad_weight = gemms.grad_weight(q_grad_t, ctx.state, weight.dtype if main_grad is None else main_grad.dtype)
        if main_grad is not None:
            main_grad.add_(grad_weight)
            grad_weight = None
        grad_bias = grad_output.sum(dim=0) if ctx.needs_input_grad[2] else None
        ctx.state = None
        return grad_input, grad_weight, grad_bias, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemms: Fp8Gemms) -> torch.Tensor:
    """Y = X W^T + b on this rank with the three GEMMs in FP8 (``gemms``); X [.., k], W [n, k] -> [.., n].
    A weight with a ``main_grad`` (the trainer's fp32 accumulator) gets dW added there (computed in
    fp32) and no .grad, as ``layers._weight_and_bias_grads`` does."""
    y = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, bias, gemms)
    return y.view(*x.shape[:-1], weight.shape[0])
