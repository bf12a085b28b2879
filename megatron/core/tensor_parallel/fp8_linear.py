"""The three GEMMs of one parallel linear layer in FP8 (fp8.py has the formats, scales and recipes).

For X [m, k] (the tokens of a micro-batch, gathered under sequence parallelism), this rank's
weight W [n, k] and the output gradient dY [m, n]:

    forward      Y  = X W^T     a = q(X),     b = q(W)
    backward     dX = dY W      a = q(dY),    b = q(W^T)
                 dW = dY^T X    a = q(dY^T),  b = q(X^T)

(``fp8.scaled_mm`` computes a b^T). Each tensor is read once for its two operands: q(x) and q(x^T)
come out of one pass (``fused_kernels.quantize_pair``): per tensor (tensorwise, delayed) with one
scale, per row (rowwise) with x's rows' scales for q(x) and its columns' for q(x^T), the rows of
the transposed operand (each row's scale is taken over the GEMM's contraction). Forward keeps
q(X^T) and q(W^T) for the backward, one byte per element, instead of X and W. The weight changes
only at the optimizer step: its two FP8 copies are made at the step's first forward and serve every
micro-batch and recomputation until ``fp8.end_fp8_step`` (after the optimizer step) or a load of the
layer's state forgets them.

Tensor parallelism: an amax taken over a dimension that the TP group splits is max-reduced over the
group before its scale is made, so every rank quantizes with the scale of the whole tensor and
TP = t computes what TP = 1 does. ``parallel_dim`` says what the group splits: "output"
(column-parallel: W's rows and dY's columns), "input" (row-parallel: W's and X's columns) or None
(one rank); the tokens are never split here. A tensor's amax is reduced when any of its dimensions
is split, a row's when the columns are, a column's when the rows are. Delayed scaling takes its
scales from the layer's history (``fp8.DelayedScaling``), into whose current row the quantization
records each tensor's amax; the trainer reduces those over every rank when the step ends.
"""
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from megatron.core.fused_kernels.fp8_ops import absolute_maxima, quantize_pair
from megatron.core.parallel_state import group_size
from megatron.core.tensor_parallel.fp8 import (ROLES, DelayedScaling, Fp8Config, Fp8Operand, saturated, scale_from_amax,
                                               scaled_mm, underflowed)
from megatron.core.tensor_parallel.utils import all_reduce_max

PARALLEL_DIMS = (None, "input", "output")


@dataclass
class Fp8Pair:
    """A tensor x [r, c] quantized both ways: ``direct`` for a GEMM reading x, ``transposed`` for one
    reading x^T (row-major [c, r])."""

    direct: Fp8Operand
    transposed: Fp8Operand


class Fp8Gemms(torch.nn.Module):
    """A linear layer's FP8 GEMMs and scaling state (module docstring). The layer calls ``output``
    in its autograd forward, ``grad_input`` and ``grad_weight`` in its backward, with 2-d views."""

    def __init__(self, config: Fp8Config, parallel_dim: str | None, tp_group: ProcessGroup | None,
                 device: torch.device | str | None = None):
        super().__init__()
        if parallel_dim not in PARALLEL_DIMS:
            raise ValueError(f"Fp8Gemms: parallel_dim must be one of {PARALLEL_DIMS}, got {parallel_dim!r}")
        self.config = config
        self.parallel_dim = parallel_dim if group_size(tp_group) > 1 else None
        self.tp_group = tp_group
        self.delayed = DelayedScaling(config, device) if config.recipe == "delayed" else None
        self._weight_pair = None

    def forget_weight(self) -> None:
        """Drop the FP8 copies of the weight: it (or its scale) changes at the optimizer step."""
        self._weight_pair = None

    def _load_from_state_dict(self, *args, **kwargs):
        self.forget_weight()
        super()._load_from_state_dict(*args, **kwargs)

    def output(self, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, tuple[Fp8Operand, Fp8Operand]]:
        """Y = X W^T for x [m, k], weight [n, k] -> (Y [m, n] in x's dtype, (q(X^T), q(W^T)) for backward)."""
        split = self.parallel_dim
        x_pair = self._quantize(x, "input", rows_split=False, columns_split=split == "input")
        if self._weight_pair is None:  # the step's first use: kept for its other micro-batches and recomputations
            self._weight_pair = self._quantize(weight, "weight", rows_split=split == "output",
                                               columns_split=split == "input")
        y = scaled_mm(x_pair.direct, self._weight_pair.direct, x.dtype, self.config.emulate)
        return y, (x_pair.transposed, self._weight_pair.transposed)

    def grad_operands(self, grad_output: torch.Tensor) -> Fp8Pair:
        """dY [m, n] quantized for both backward GEMMs, in one pass."""
        return self._quantize(grad_output, "grad_output", rows_split=False,
                              columns_split=self.parallel_dim == "output")

    def grad_input(self, grad: Fp8Pair, saved: tuple[Fp8Operand, Fp8Operand], dtype: torch.dtype) -> torch.Tensor:
        """dX = dY W [m, k] in ``dtype``."""
        return scaled_mm(grad.direct, saved[1], dtype, self.config.emulate)

    def grad_weight(self, grad: Fp8Pair, saved: tuple[Fp8Operand, Fp8Operand], dtype: torch.dtype) -> torch.Tensor:
        """dW = dY^T X [n, k] in ``dtype`` (fp32 to add into a main_grad)."""
        return scaled_mm(grad.transposed, saved[0], dtype, self.config.emulate)

    def _quantize(self, x: torch.Tensor, role: str, rows_split: bool, columns_split: bool) -> Fp8Pair:
        """x [r, c] -> q(x) and q(x^T) with the recipe's scales (module docstring)."""
        dtype, margin = self.config.dtype(role), self.config.margin
        record = None
        if self.delayed is not None:
            record = self.delayed.amax_history[0, ROLES.index(role)]
            if self.delayed.has_scales:
                scale = self.delayed.role_scale(role)
                direct, transposed = quantize_pair(x, dtype, scale, scale, record)
                return Fp8Pair(Fp8Operand(direct, scale), Fp8Operand(transposed, scale))
        if self.config.recipe == "rowwise":
            _, row_amax, column_amax = absolute_maxima(x, tensor=False, rows=True, columns=True)
            if columns_split:
                row_amax = all_reduce_max(row_amax, self.tp_group)
            if rows_split:
                column_amax = all_reduce_max(column_amax, self.tp_group)
            row_scale, column_scale = scale_from_amax(row_amax, dtype, margin), scale_from_amax(column_amax, dtype, margin)
            direct, transposed = quantize_pair(x, dtype, row_scale, column_scale)
            return Fp8Pair(Fp8Operand(direct, row_scale), Fp8Operand(transposed, column_scale.reshape(-1, 1)))
        amax, _, _ = absolute_maxima(x)  # tensorwise, and delayed scaling's first step (DelayedScaling)
        if rows_split or columns_split:
            amax = all_reduce_max(amax, self.tp_group)
        scale = scale_from_amax(amax, dtype, margin)
        direct, transposed = quantize_pair(x, dtype, scale, scale, record)
        return Fp8Pair(Fp8Operand(direct, scale), Fp8Operand(transposed, scale))


class _Fp8Matmul(torch.autograd.Function):
    """Y = X W^T + b for X [m, k] (2-d), W [n, k], with the three GEMMs of ``gemms``."""

    @staticmethod
    def forward(ctx, x, weight, bias, gemms):
        y, ctx.saved = gemms.output(x, weight)
        ctx.gemms, ctx.weight = gemms, weight
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad_output):
        gemms, weight = ctx.gemms, ctx.weight
        grad = gemms.grad_operands(grad_output)
        grad_input = gemms.grad_input(grad, ctx.saved, grad_output.dtype)
        main_grad = getattr(weight, "main_grad", None)
        grad_weight = gemms.grad_weight(grad, ctx.saved, weight.dtype if main_grad is None else main_grad.dtype)
        if main_grad is not None:
            main_grad.add_(grad_weight)
            grad_weight = None
        grad_bias = grad_output.sum(dim=0) if ctx.needs_input_grad[2] else None
        ctx.saved = None
        return grad_input, grad_weight, grad_bias, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemms: Fp8Gemms) -> torch.Tensor:
    """Y = X W^T + b on this rank with the three GEMMs in FP8 (``gemms``); X [.., k], W [n, k] -> [.., n].
    A weight with a ``main_grad`` (the trainer's fp32 accumulator) gets dW added there (computed in
    fp32) and no .grad, as ``layers._weight_and_bias_grads`` does."""
    y = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, bias, gemms)
    return y.view(*x.shape[:-1], weight.shape[0])


@dataclass
class Fp8StepCounts:
    """Of one step's delayed-scaling amaxes (tensors and roles, over every layer): how many saturated
    their scale (``saturated``) and how many underflowed it (``underflowed``); 0-d tensors."""

    overflows: torch.Tensor
    underflows: torch.Tensor


def end_fp8_step(module: torch.nn.Module, groups: list[ProcessGroup | None]) -> Fp8StepCounts | None:
    """Ends the step of every FP8 layer in ``module`` (after the optimizer step): their FP8 weight
    copies are forgotten, and for delayed scaling this step's amaxes (row 0 of the histories, one
    [layers, 3] tensor) are max-reduced over each of ``groups`` in turn (the ranks that hold the
    same layers: TP, then DP) before each layer's new scales. Returns the delayed amaxes' counts,
    None without delayed scaling."""
    layers = [child for child in module.modules() if isinstance(child, Fp8Gemms)]
    for layer in layers:
        layer.forget_weight()
    states = [layer.delayed for layer in layers if layer.delayed is not None]
    if not states:
        return None
    recorded = torch.stack([state.amax_history[0] for state in states])
    for group in groups:
        recorded = all_reduce_max(recorded, group)
    overflows, underflows = [], []
    for state, amax in zip(states, recorded):
        state.amax_history[0].copy_(amax)
        amaxes, scales = state.end_step()
        for index, role in enumerate(ROLES):
            dtype = state.config.dtype(role)
            overflows.append(saturated(amaxes[index], scales[index], dtype))
            underflows.append(underflowed(amaxes[index], scales[index], dtype))
    return Fp8StepCounts(torch.stack(overflows).sum(), torch.stack(underflows).sum())
