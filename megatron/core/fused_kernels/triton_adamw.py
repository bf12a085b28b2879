"""Triton AdamW step over one flat fp32 tensor that also writes the weights' low-precision copy.

Per element (``training_ops.adamw_step`` states the math): read p, g, m, v (fp32), write p, m, v and
the copy of p in its dtype (bf16 for the trainer's weights): 30 bytes per parameter with a bf16
copy, in one pass, where torch's fused AdamW and a separate cast move 38. The two step-dependent
scalars, lr / (1 - beta1^t) and sqrt(1 - beta2^t), come from a 2-element device tensor
(``reference.adamw_bias_corrections``), so the step count is never read on the host. Divisions and
the square root round to nearest, as torch's CUDA kernel does. Offsets are int64: a flat partition
can pass 2^31 elements.

This module imports triton; ``selection.kernel_module`` imports it only when a CUDA tensor needs it.
"""
import triton
import triton.language as tl

from megatron.core.fused_kernels.launch import cdiv
from megatron.core.fused_kernels.reference import adamw_bias_corrections

BLOCK = 4096
NUM_WARPS = 16


@triton.jit
def _adamw_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, copy_ptr, corrections_ptr, grad_scale_ptr, n_elements,
    lr_times_weight_decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps,
    HAS_GRAD_SCALE: tl.constexpr, WRITE_COPY: tl.constexpr, BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = offsets < n_elements
    step_size = tl.load(corrections_ptr)
    bias_correction2_sqrt = tl.load(corrections_ptr + 1)
    grad = tl.load(grad_ptr + offsets, mask=in_bounds, other=0.0)
    if HAS_GRAD_SCALE:
        grad = tl.div_rn(grad, tl.load(grad_scale_ptr))
    param = tl.load(param_ptr + offsets, mask=in_bounds, other=0.0)
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=in_bounds, other=0.0)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=in_bounds, other=0.0)
    param = param - lr_times_weight_decay * param
    exp_avg = beta1 * exp_avg + one_minus_beta1 * grad
    exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * grad * grad
    denominator = tl.div_rn(tl.sqrt_rn(exp_avg_sq), bias_correction2_sqrt) + eps
    param = param - tl.div_rn(step_size * exp_avg, denominator)
    tl.store(param_ptr + offsets, param, mask=in_bounds)
    tl.store(exp_avg_ptr + offsets, exp_avg, mask=in_bounds)
    tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=in_bounds)
    if WRITE_COPY:
        tl.store(copy_ptr + offsets, param.to(copy_ptr.dtype.element_ty), mask=in_bounds)


def adamw_step(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay,
               grad_scale=None, param_copy=None, block=BLOCK, num_warps=NUM_WARPS):
    """``training_ops.adamw_step`` on contiguous CUDA tensors (fp32 but ``param_copy``): one launch."""
    corrections = adamw_bias_corrections(step, lr, beta1, beta2)
    n_elements = param.numel()
    _adamw_kernel[(cdiv(n_elements, block),)](
        param, grad, exp_avg, exp_avg_sq, param if param_copy is None else param_copy, corrections,
        corrections if grad_scale is None else grad_scale, n_elements,
        lr * weight_decay, beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps,
        HAS_GRAD_SCALE=grad_scale is not None, WRITE_COPY=param_copy is not None, BLOCK=block, num_warps=num_warps,
    )
