"""FP8 matrix products for the parallel linear layers: formats, scaling recipes and the three GEMMs.

An operand x of a linear layer (its input X, weight W or output gradient dY) is quantized with a
scale s that maps its largest magnitude near the top of an FP8 format f:

    q = sat_f(round_f(x s)),   x ~ q / s,   s = f_max / (amax 2^margin)

round_f rounds to f (e4m3: f_max = 448, 3 mantissa bits; e5m2: f_max = 57344, 2 bits) and sat_f
clamps to +-f_max, so a value above the amax the scale was made for saturates instead of becoming
inf. An amax of 0 (or not finite) gives s = 1. Formats (Megatron-LM's --fp8-format): "e4m3" for all
three operands; "hybrid" e5m2 for the gradient dY (range) and e4m3 for X and W (precision).

Recipes (--fp8-recipe) choose amax:
    tensorwise  one scale per tensor, from its current amax = max |x|
    rowwise     one scale per row of each GEMM operand as the GEMM reads it: a token of X or dY, an
                output row of W in Y = X W^T; the columns for the operands that dX = dY W and
                dW = dY^T X read transposed
    delayed     one scale per tensor and role from the amaxes of earlier steps (``DelayedScaling``)

The three GEMMs of a linear layer, for X [m, k] (a micro-batch's tokens), W [n, k], dY [m, n]:

    Y  = X W^T    ~  (q_X q_W^T) / (s_X s_W)
    dX = dY W     ~  (q_dY q_W) / (s_dY s_W)
    dW = dY^T X   ~  (q_dY^T q_X) / (s_dY s_X)

``scaled_mm`` computes a b^T from two quantized operands [m, k] and [n, k] with fp32 accumulation
and returns it in the layer's dtype: torch._scaled_mm on CUDA, or, with ``emulate``, the same
quantized values dequantized to fp32 around a plain matmul (the CPU mode of the tests).
"""
from dataclasses import dataclass

import torch

from megatron.core.fused_kernels.fp8_ops import absolute_maxima, scale_from_amax_reference
from megatron.core.fused_kernels.fp8_ops import saturating_cast as quantize  # sat(round(x s)) above

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "rowwise")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
ROLES = ("input", "weight", "grad_output")  # the operand roles, in DelayedScaling's order


class Fp8ConfigError(ValueError):
    """FP8 settings that cannot work; the message names the flag."""


@dataclass(frozen=True)
class Fp8Config:
    """--fp8-format, --fp8-recipe, --fp8-amax-history-len, --fp8-amax-compute-algo, --fp8-margin
    (Megatron-LM's defaults), and ``emulate``: quantize and dequantize around plain matmuls
    instead of FP8 GEMMs (CPU tests)."""

    format: str = "hybrid"
    recipe: str = "delayed"
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    margin: int = 0
    emulate: bool = False

    def __post_init__(self):
        for flag, value, choices in (("--fp8-format", self.format, FP8_FORMATS),
                                     ("--fp8-recipe", self.recipe, FP8_RECIPES),
                                     ("--fp8-amax-compute-algo", self.amax_compute_algo, AMAX_COMPUTE_ALGOS)):
            if value not in choices:
                raise Fp8ConfigError(f"{flag} {value}: choose one of {', '.join(choices)}")
        if self.amax_history_len < 1:
            raise Fp8ConfigError(f"--fp8-amax-history-len {self.amax_history_len}: must be >= 1")
        if self.margin < 0:
            raise Fp8ConfigError(f"--fp8-margin {self.margin}: must be >= 0")

    def dtype(self, role: str) -> torch.dtype:
        """The FP8 dtype of an operand role ("input", "weight", "grad_output")."""
        return torch.float8_e5m2 if self.format == "hybrid" and role == "grad_output" else torch.float8_e4m3fn


def format_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, margin: int) -> torch.Tensor:
    """s = f_max / (amax 2^margin) in fp32, elementwise; 1 where amax is 0 or not finite."""
    return scale_from_amax_reference(amax, format_max(dtype), margin)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q / s in fp32."""
    return q.float() / scale


@dataclass
class Fp8Operand:
    """A 2-d operand [r, c] quantized for ``scaled_mm``: data q (row-major) and its scale s (a
    scalar, or [r, 1] per row), x ~ q / s; ``inverse`` 1 / s when it was made with s (else the
    GEMM takes the reciprocal itself)."""

    data: torch.Tensor
    scale: torch.Tensor
    inverse: torch.Tensor | None = None

    @property
    def rowwise(self) -> bool:
        return self.scale.dim() > 0

    def inverse_scale(self) -> torch.Tensor:
        return self.scale.reciprocal() if self.inverse is None else self.inverse

    def rows(self, start: int, end: int) -> "Fp8Operand":
        """Rows [start, end) with their scales."""
        if not self.rowwise:
            return Fp8Operand(self.data[start:end], self.scale, self.inverse)
        return Fp8Operand(self.data[start:end], self.scale[start:end],
                          None if self.inverse is None else self.inverse[start:end])


def quantize_operand(x: torch.Tensor, dtype: torch.dtype, margin: int, rowwise: bool,
                     amax: torch.Tensor | None = None) -> Fp8Operand:
    """x [r, c] quantized with the scale of ``amax`` (default: x's own, per row when ``rowwise``)."""
    if amax is None:
        tensor_amax, row_amax, _ = absolute_maxima(x, tensor=not rowwise, rows=rowwise)
        amax = row_amax if rowwise else tensor_amax
    scale = scale_from_amax(amax, dtype, margin)
    return Fp8Operand(quantize(x, scale, dtype).contiguous(), scale)


def scaled_mm(a: Fp8Operand, b: Fp8Operand, out_dtype: torch.dtype, emulate: bool,
              out: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a b^T + c ~ (q_a / s_a)(q_b / s_b)^T + c for a [m, k], b [n, k] and a bias c [n] (or none) ->
    [m, n] in ``out_dtype`` (written into ``out`` when given), with fp32 accumulation:
    torch._scaled_mm (q_b^T is column-major as it wants; a bf16 or fp16 bias of the output's dtype
    added in its epilogue, another after it), or with ``emulate`` the dequantized operands' fp32
    matmul, the bias added in fp32."""
    if emulate:
        product = dequantize(a.data, a.scale).matmul(dequantize(b.data, b.scale).t())
        product = (product if bias is None else product + bias.float()).to(out_dtype)
        return product if out is None else out.copy_(product)
    scale_a = a.inverse_scale()
    scale_b = b.inverse_scale().reshape(1, -1) if b.rowwise else b.inverse_scale()
    in_epilogue = bias is not None and bias.dtype == out_dtype and out_dtype in (torch.bfloat16, torch.float16)
    extra = {"bias": bias} if in_epilogue else {}
    if out is not None:
        extra["out"] = out
    product = torch._scaled_mm(a.data, b.data.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, **extra)
    if bias is not None and not in_epilogue:
        product += bias
    return product


class DelayedScaling(torch.nn.Module):
    """Delayed scaling of one linear layer: for each role r (input, weight, grad_output) the amax
    history H_r [len] (row 0: the amaxes recorded during this step, rows 1..: earlier steps) and the
    scale s_r used during this step:

        during a step   a GEMM quantizes its operand of role r with s_r and folds max |x| into H_r[0]
                        (``fused_kernels.quantize_pair``'s record: the maximum over the step's
                        micro-batches and recomputations)
        at its end      H[0] is reduced over the ranks sharing the layer (``end_step``'s reduce), then
                        s_r = f_max / (a_r 2^margin) with a_r = max_i H_r[i] ("max") or H_r[0]
                        ("most_recent"); the history shifts by one and H[0] restarts at 0

    So every use of the layer within a step (forward, its recomputation, backward) has the same
    scales, and the buffers (saved with the model) restore a run exactly. Before the first step ends
    there is no amax yet: the scales are 0 (``has_scales`` False) and ``Fp8Gemms`` quantizes each
    operand with its own current amax, as the tensorwise recipe does, while recording it. (A scale
    of 1 instead would let most of the first step's e5m2 gradients, ~1e-6, underflow to 0.)
    """

    def __init__(self, config: Fp8Config, device: torch.device | str | None = None):
        super().__init__()
        self.config = config
        self.register_buffer("amax_history", torch.zeros(config.amax_history_len, len(ROLES), device=device))
        self.register_buffer("scale", torch.zeros(len(ROLES), device=device))
        for role in ROLES:  # 1 / scale, each its own allocation: cuBLASLt rejects a scale pointer inside a tensor
            self.register_buffer(f"inverse_{role}", torch.zeros((), device=device), persistent=False)
        self.has_scales = False  # host-side mirror of scale > 0, so that no GEMM waits on the device to ask

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.has_scales = bool((self.scale > 0).all())
        if self.has_scales:
            torch._foreach_copy_(self.inverses(), list(self.scale.reciprocal().unbind(0)))

    def inverses(self) -> list[torch.Tensor]:
        """1 / scale of each role, in ROLES' order."""
        return [getattr(self, f"inverse_{role}") for role in ROLES]

    def role_scale(self, role: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The role's scale (a 0-d view) and its inverse."""
        return self.scale[ROLES.index(role)], getattr(self, f"inverse_{role}")

    def end_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """New scales from the history (its row 0 already reduced over the ranks); returns the step's
        amaxes and the scales they were quantized with, [3] each, for overflow counts
        (``end_delayed_steps`` of this layer alone)."""
        recorded, used = end_delayed_steps([self], self.amax_history[0].unsqueeze(0).clone())
        return recorded[0], used[0]


def end_delayed_steps(states: list[DelayedScaling], recorded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ends the step of L layers' delayed scaling (one config) in a few batched kernels, whatever L:
    ``recorded`` [L, 3] is their step's amaxes reduced over the ranks; each layer's history takes it
    as row 0, makes its new scales (``DelayedScaling``), shifts by one and restarts row 0 at 0.
    Returns (recorded, the scales they were quantized with) [L, 3]; after a layer's first step those
    are its new scales themselves: each operand had its own amax's, which fit."""
    config = states[0].config
    if any(state.config != config for state in states):
        raise ValueError("end_delayed_steps: the layers' delayed scaling settings differ; end each group apart")
    histories = torch.stack([state.amax_history for state in states])  # [L, len, 3]
    histories[:, 0] = recorded
    used = torch.stack([state.scale for state in states])  # [L, 3]
    amax = histories.amax(dim=1) if config.amax_compute_algo == "max" else recorded
    scales = torch.stack([scale_from_amax(amax[:, index], config.dtype(role), config.margin)
                          for index, role in enumerate(ROLES)], dim=1)  # [L, 3]
    first = [not state.has_scales for state in states]
    if all(first):
        used = scales.clone()
    elif any(first):
        used = torch.where(torch.tensor(first, device=used.device).unsqueeze(1), scales, used)
    shifted = torch.roll(histories, shifts=1, dims=1)
    shifted[:, 0] = 0
    torch._foreach_copy_([state.amax_history for state in states], list(shifted.unbind(0)))
    torch._foreach_copy_([state.scale for state in states], list(scales.unbind(0)))
    torch._foreach_copy_([inverse for state in states for inverse in state.inverses()],
                         list(scales.reciprocal().flatten().unbind(0)))
    for state in states:
        state.has_scales = True
    return recorded, used


def saturated(amax: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Whether amax s exceeds f_max: values of that tensor were clamped (an overflowing amax)."""
    return amax * scale > format_max(dtype)


def underflowed(amax: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Whether amax s falls below f's smallest normal: the whole tensor sat in the subnormals (or was
    0), an amax far below the one its scale was made for."""
    return amax * scale < torch.finfo(dtype).smallest_normal
