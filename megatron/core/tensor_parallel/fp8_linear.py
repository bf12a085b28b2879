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
(one rank); the tokens are split only under --tp-comm-overlap (below). A tensor's amax is reduced
when any of its dimensions is split, a row's when the columns are, a column's when the rows are.
Delayed scaling takes its scales from the layer's history (``fp8.DelayedScaling``), into whose
current row the quantization records each tensor's amax; the trainer reduces those over every rank
when the step ends.

With --tp-comm-overlap (sequence parallelism) the pipelined collectives of ``async_tp`` hand the
GEMMs one sequence block of k at a time: ``Fp8Gemms.scales`` first makes the scales of the whole
tensor from this rank's block (its amaxes reduced over the group), then ``quantize_block``
quantizes each block with them, so the FP8 values are the plain path's. ``fp8_gathered_linear``
(column-parallel) and ``fp8_scattered_linear`` (row-parallel) are those layers' products.
"""
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from megatron.core.fused_kernels.fp8_ops import absolute_maxima, quantize_pair, scales_from_amax
from megatron.core.parallel_state import group_size
from megatron.core.tensor_parallel.async_tp import (RowBlockProduct, all_gather_each_block, reduce_scatter_product,
                                                    start_reduce_scatter_product)
from megatron.core.tensor_parallel.fp8 import (ROLES, DelayedScaling, Fp8Config, Fp8Operand, end_delayed_steps,
                                               format_max, saturated, scaled_mm, underflowed)
from megatron.core.tensor_parallel.utils import all_reduce_max, divide

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

    def output(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[Fp8Operand, Fp8Operand]]:
        """Y = X W^T + b for x [m, k], weight [n, k], bias [n] or None -> (Y [m, n] in x's dtype,
        (q(X^T), q(W^T)) for backward)."""
        x_pair = self._quantize(x, "input", rows_split=False, columns_split=self.parallel_dim == "input")
        weight_pair = self.weight_pair(weight)
        y = scaled_mm(x_pair.direct, weight_pair.direct, x.dtype, self.config.emulate, bias=bias)
        return y, (x_pair.transposed, weight_pair.transposed)

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
        return self.quantize_block(x, self.scales(x, role, rows_split, columns_split))

    def scales(self, x: torch.Tensor, role: str, rows_split: bool, columns_split: bool,
               own_rows: bool = True) -> "Fp8Scales":
        """The scales that quantize x [r, c], or any block of its rows (``quantize_block``), as one
        tensor. ``rows_split``/``columns_split``: the TP group holds the rest of the tensor's rows
        or columns (module docstring). ``own_rows`` False (rowwise, rows split): x is this rank's block
        of rows and the other ranks' blocks will be quantized here too, each with its own rows' scales."""
        dtype, margin = self.config.dtype(role), self.config.margin
        record = None
        if self.delayed is not None:
            record = self.delayed.amax_history[0, ROLES.index(role)]
            if self.delayed.has_scales:
                scale, inverse = self.delayed.role_scale(role)
                return Fp8Scales(dtype, scale, scale, record, inverse, inverse)
        limit = format_max(dtype)
        if self.config.recipe == "rowwise":
            _, row_amax, column_amax = absolute_maxima(x, tensor=False, rows=own_rows, columns=True)
            if columns_split and own_rows:
                row_amax = all_reduce_max(row_amax, self.tp_group)
            if rows_split:
                column_amax = all_reduce_max(column_amax, self.tp_group)
            row_scale, row_inverse = scales_from_amax(row_amax, limit, margin) if own_rows else (None, None)
            column_scale, column_inverse = scales_from_amax(column_amax, limit, margin)
            return Fp8Scales(dtype, row_scale, column_scale, record, row_inverse, column_inverse)
        amax, _, _ = absolute_maxima(x)  # tensorwise, and delayed scaling's first step (DelayedScaling)
        if rows_split or columns_split:
            amax = all_reduce_max(amax, self.tp_group)
        scale, inverse = scales_from_amax(amax, limit, margin)
        return Fp8Scales(dtype, scale, scale, record, inverse, inverse)

    def quantize_block(self, block: torch.Tensor, scales: "Fp8Scales", start: int = 0) -> Fp8Pair:
        """Rows [start, start + len(block)) of the tensor ``scales`` was made for -> q(block) and
        q(block^T); rowwise scales without rows (``own_rows`` False) take the block's own rows' amaxes."""
        row_scale, row_inverse = scales.row, scales.row_inverse
        if row_scale is None:
            _, row_amax, _ = absolute_maxima(block, tensor=False, rows=True)
            row_scale, row_inverse = scales_from_amax(row_amax, format_max(scales.dtype), self.config.margin)
        elif row_scale.dim() > 0:
            end = start + block.shape[0]
            row_scale, row_inverse = row_scale[start:end], row_inverse[start:end]
        direct, transposed = quantize_pair(block, scales.dtype, row_scale, scales.column, scales.record)
        return Fp8Pair(Fp8Operand(direct, row_scale, row_inverse), scales.transposed(transposed))

    def gathered_output(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        group: ProcessGroup) -> tuple[torch.Tensor, tuple[Fp8Operand, Fp8Operand]]:
        """Y = X W^T + b for X [k n, c] the all-gather of the ranks' blocks x [n, c] (sequence
        parallelism with --tp-comm-overlap): each block quantized as it arrives
        (``all_gather_each_block``) with the scales of the whole X and multiplied -> (Y [k n, out],
        (q(X^T) [c, k n], q(W^T)))."""
        scales = self.scales(x, "input", rows_split=True, columns_split=False, own_rows=False)
        weight_pair = self.weight_pair(weight)
        ranks, rows = group_size(group), x.shape[0]
        y = x.new_empty(ranks * rows, weight.shape[0])
        transposed = torch.empty(x.shape[1], ranks * rows, dtype=scales.dtype, device=x.device)

        def multiply(rank: int, block: torch.Tensor) -> None:
            pair = self.quantize_block(block, scales)
            own = slice(rank * rows, (rank + 1) * rows)
            scaled_mm(pair.direct, weight_pair.direct, x.dtype, self.config.emulate, out=y[own], bias=bias)
            transposed[:, own].copy_(pair.transposed.data)

        all_gather_each_block(x, group, multiply)
        return y, (scales.transposed(transposed), weight_pair.transposed)

    def scattered_output(self, x: torch.Tensor, weight: torch.Tensor,
                         group: ProcessGroup) -> tuple[torch.Tensor, tuple[list[Fp8Operand], Fp8Operand]]:
        """Rank r's block of rows of the sum over ranks of X W^T, x [k n, c] (sequence parallelism
        with --tp-comm-overlap): X's row blocks quantized one by one into the pipelined reduce-scatter
        (``reduce_scatter_product``) -> (Y [n, out], (q(X_q^T) for each row block q, q(W^T)))."""
        scales = self.scales(x, "input", rows_split=False, columns_split=self.parallel_dim == "input")
        weight_pair = self.weight_pair(weight)
        ranks = group_size(group)
        rows = divide(x.shape[0], ranks)
        transposed = [None] * ranks

        def block_operand(start: int, end: int) -> Fp8Operand:
            pair = self.quantize_block(x[start:end], scales, start)
            transposed[start // rows] = pair.transposed
            return pair.direct

        product = _Fp8RowBlocks(x.shape[0], block_operand, weight_pair.direct, x.dtype, x.device,
                                self.config.emulate, ranks)
        return reduce_scatter_product(product, group), (transposed, weight_pair.transposed)

    def gathered_grads(self, grad_output: torch.Tensor, saved: tuple[list[Fp8Operand], Fp8Operand],
                       weight: torch.Tensor, group: ProcessGroup) -> tuple[torch.Tensor, torch.Tensor | None]:
        """scattered_output's backward: dY [k n, out] the all-gather of the ranks' blocks ``grad_output``
        [n, out], each quantized as it arrives (with the scales of the whole dY) into its block of
        dX = dY W and its share dY_q^T X_q of dW -> (dX [k n, c], dW or None when added to a main_grad)."""
        scales = self.scales(grad_output, "grad_output", rows_split=True, columns_split=False, own_rows=False)
        x_blocks, weight_transposed = saved
        ranks, rows = group_size(group), grad_output.shape[0]
        grad_input = grad_output.new_empty(ranks * rows, weight_transposed.data.shape[0])
        grad_weights = []

        def use_block(rank: int, block: torch.Tensor) -> None:
            pair = self.quantize_block(block, scales)
            scaled_mm(pair.direct, weight_transposed, grad_output.dtype, self.config.emulate,
                      out=grad_input[rank * rows:(rank + 1) * rows])
            grad_weight = _weight_gradient(weight, lambda dtype: scaled_mm(pair.transposed, x_blocks[rank], dtype,
                                                                           self.config.emulate))
            if grad_weight is not None:
                grad_weights.append(grad_weight)

        all_gather_each_block(grad_output, group, use_block)
        return grad_input, sum(grad_weights) if grad_weights else None

    def weight_pair(self, weight: torch.Tensor) -> Fp8Pair:
        """q(W) and q(W^T), made at the step's first use and kept for its other micro-batches and
        recomputations."""
        if self._weight_pair is None:
            split = self.parallel_dim
            self._weight_pair = self._quantize(weight, "weight", rows_split=split == "output",
                                               columns_split=split == "input")
        return self._weight_pair


@dataclass
class Fp8Scales:
    """What quantizes the blocks of one tensor alike (``Fp8Gemms.scales``): its FP8 dtype, the row
    scale (a scalar, [r, 1] per row, or None: each block's own rows') and column scale (a scalar or
    [c]), delayed scaling's amax record (or None), and the scales' inverses."""

    dtype: torch.dtype
    row: torch.Tensor | None
    column: torch.Tensor
    record: torch.Tensor | None
    row_inverse: torch.Tensor | None
    column_inverse: torch.Tensor

    def transposed(self, data: torch.Tensor) -> Fp8Operand:
        """q(x^T) ``data`` with its scales: the column scales, one per row of x^T."""
        if self.column.dim() == 0:
            return Fp8Operand(data, self.column, self.column_inverse)
        return Fp8Operand(data, self.column.reshape(-1, 1), self.column_inverse.reshape(-1, 1))


class _Fp8RowBlocks(RowBlockProduct):
    """a b^T [n, p] in FP8 by blocks of rows for the pipelined reduce-scatter: ``block_operand(i, j)``
    gives rows [i, j) of a quantized (each block asked for once), b is quantized whole [p, m]; the
    plain collectives' ``whole`` takes the same ``blocks`` blocks one after the other."""

    def __init__(self, rows: int, block_operand, b: Fp8Operand, dtype: torch.dtype, device: torch.device,
                 emulate: bool, blocks: int):
        self.rows, self.columns, self.dtype, self.device = rows, b.data.shape[0], dtype, device
        self.block_operand, self.b, self.emulate, self.blocks = block_operand, b, emulate, blocks

    def into(self, start: int, end: int, out: torch.Tensor) -> None:
        scaled_mm(self.block_operand(start, end), self.b, self.dtype, self.emulate, out=out)

    def add_into(self, start: int, end: int, out: torch.Tensor) -> None:
        out += scaled_mm(self.block_operand(start, end), self.b, self.dtype, self.emulate)

    def whole(self) -> torch.Tensor:
        rows = divide(self.rows, self.blocks)
        return torch.cat([scaled_mm(self.block_operand(start, start + rows), self.b, self.dtype, self.emulate)
                          for start in range(0, self.rows, rows)])


def _weight_gradient(weight: torch.Tensor, grad_weight_of) -> torch.Tensor | None:
    """dW from ``grad_weight_of(dtype)``: added into ``weight.main_grad`` (computed in its dtype, fp32)
    and None returned when the weight has one, else returned in the weight's dtype."""
    main_grad = getattr(weight, "main_grad", None)
    grad_weight = grad_weight_of(weight.dtype if main_grad is None else main_grad.dtype)
    if main_grad is None:
        return grad_weight
    main_grad.add_(grad_weight)
    return None


class _Fp8Matmul(torch.autograd.Function):
    """Y = X W^T + b for X [m, k] (2-d), W [n, k], with the three GEMMs of ``gemms``."""

    @staticmethod
    def forward(ctx, x, weight, bias, gemms):
        y, ctx.saved = gemms.output(x, weight, bias)
        ctx.gemms, ctx.weight = gemms, weight
        return y

    @staticmethod
    def backward(ctx, grad_output):
        gemms, weight = ctx.gemms, ctx.weight
        grad = gemms.grad_operands(grad_output)
        grad_input = gemms.grad_input(grad, ctx.saved, grad_output.dtype)
        grad_weight = _weight_gradient(weight, lambda dtype: gemms.grad_weight(grad, ctx.saved, dtype))
        grad_bias = grad_output.sum(dim=0) if ctx.needs_input_grad[2] else None
        ctx.saved = None
        return grad_input, grad_weight, grad_bias, None


class _Fp8GatheredMatmul(torch.autograd.Function):
    """Y = X W^T + b for X [k n, c] gathered from the ranks' sequence blocks x [n, c] (the
    column-parallel layer under --tp-comm-overlap), GEMMs in FP8 (``Fp8Gemms.gathered_output``);
    backward pipelines dX = dY W with its reduce-scatter by blocks of q(dY)'s rows
    (``start_reduce_scatter_product``) and computes dW = dY^T X from the kept q(X^T) beside the
    transfers."""

    @staticmethod
    def forward(ctx, x, weight, bias, gemms, group):
        y, ctx.saved = gemms.gathered_output(x, weight, bias, group)
        ctx.gemms, ctx.weight, ctx.group = gemms, weight, group
        return y

    @staticmethod
    def backward(ctx, grad_output):
        gemms, weight, saved = ctx.gemms, ctx.weight, ctx.saved
        grad = gemms.grad_operands(grad_output)
        product = _Fp8RowBlocks(grad_output.shape[0], grad.direct.rows, saved[1],
                                grad_output.dtype, grad_output.device, gemms.config.emulate, group_size(ctx.group))
        grad_input, reduction = start_reduce_scatter_product(product, ctx.group)  # [n, c]
        grad_weight = _weight_gradient(weight, lambda dtype: gemms.grad_weight(grad, saved, dtype))
        grad_bias = grad_output.sum(dim=0) if ctx.needs_input_grad[2] else None
        reduction.wait()
        ctx.saved = None
        return grad_input, grad_weight, grad_bias, None, None


class _Fp8ScatteredMatmul(torch.autograd.Function):
    """Rank r's sequence block of the sum over ranks of X_r W_r^T (the row-parallel layer under
    --tp-comm-overlap), GEMMs in FP8: ``Fp8Gemms.scattered_output`` forward, ``gathered_grads`` backward."""

    @staticmethod
    def forward(ctx, x, weight, gemms, group):
        y, ctx.saved = gemms.scattered_output(x, weight, group)
        ctx.gemms, ctx.weight, ctx.group = gemms, weight, group
        return y

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_weight = ctx.gemms.gathered_grads(grad_output, ctx.saved, ctx.weight, ctx.group)
        ctx.saved = None
        return grad_input, grad_weight, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemms: Fp8Gemms) -> torch.Tensor:
    """Y = X W^T + b on this rank with the three GEMMs in FP8 (``gemms``); X [.., k], W [n, k] -> [.., n].
    A weight with a ``main_grad`` (the trainer's fp32 accumulator) gets dW added there (computed in
    fp32) and no .grad, as ``layers._weight_and_bias_grads`` does."""
    y = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, bias, gemms)
    return y.view(*x.shape[:-1], weight.shape[0])


def fp8_gathered_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemms: Fp8Gemms,
                        group: ProcessGroup) -> torch.Tensor:
    """The column-parallel FP8 product under --tp-comm-overlap: X W^T + b for X the all-gather along
    dim 0 of the ranks' blocks x [n, .., c] -> [k n, .., out]."""
    y = _Fp8GatheredMatmul.apply(x.reshape(-1, x.shape[-1]), weight, bias, gemms, group)
    return y.view(group_size(group) * x.shape[0], *x.shape[1:-1], weight.shape[0])


def fp8_scattered_linear(x: torch.Tensor, weight: torch.Tensor, gemms: Fp8Gemms, group: ProcessGroup) -> torch.Tensor:
    """The row-parallel FP8 product under --tp-comm-overlap: rank r's block along dim 0 of the sum
    over ranks of X_r W_r^T, x [k n, .., c] -> [n, .., out]."""
    y = _Fp8ScatteredMatmul.apply(x.reshape(-1, x.shape[-1]), weight, gemms, group)
    return y.view(x.shape[0] // group_size(group), *x.shape[1:-1], weight.shape[0])


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
    same layers: TP, then DP) before each layer's new scales, all layers of one setting at once
    (``end_delayed_steps``: a few kernels per step, which at one launch per value would take the
    host longer than a small model's step). Returns the delayed amaxes' counts, None without
    delayed scaling."""
    layers = [child for child in module.modules() if isinstance(child, Fp8Gemms)]
    for layer in layers:
        layer.forget_weight()
    states = [layer.delayed for layer in layers if layer.delayed is not None]
    if not states:
        return None
    overflows, underflows = [], []
    for config in dict.fromkeys(state.config for state in states):
        alike = [state for state in states if state.config == config]
        recorded = torch.stack([state.amax_history[0] for state in alike])
        for group in groups:
            recorded = all_reduce_max(recorded, group)
        amaxes, scales = end_delayed_steps(alike, recorded)
        for index, role in enumerate(ROLES):
            dtype = config.dtype(role)
            overflows.append(saturated(amaxes[:, index], scales[:, index], dtype).sum())
            underflows.append(underflowed(amaxes[:, index], scales[:, index], dtype).sum())
    return Fp8StepCounts(torch.stack(overflows).sum(), torch.stack(underflows).sum())
