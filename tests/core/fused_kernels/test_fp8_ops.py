"""FP8 quantization's passes (fused_kernels/fp8_ops.py): the Triton kernels against the references on a
GPU, bit for bit, the scales' reference against fp8.py's, and the argument checks on any machine."""
import pytest
import torch

from megatron.core.fused_kernels import fp8_ops
from megatron.core.fused_kernels.selection import FusedKernelArgumentError

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _matrix(shape, dtype, strided):
    """Random values over six orders of magnitude; ``strided``: a column slice of a wider matrix."""
    torch.manual_seed(0)
    wide = torch.randn(shape[0], shape[1] + (24 if strided else 0), device="cuda")
    wide = wide * torch.logspace(-3, 3, wide.shape[1], device="cuda")
    return wide.to(dtype)[:, :shape[1]]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(256, 192), (100, 70), (1, 1000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("strided", [False, True])
def test_absolute_maxima_kernel_equals_the_reference(shape, dtype, strided):
    x = _matrix(shape, dtype, strided)
    found = fp8_ops.absolute_maxima(x, tensor=True, rows=True, columns=True)
    expected = fp8_ops.absolute_maxima_reference(x, tensor=True, rows=True, columns=True)
    for one, other in zip(found, expected):
        assert torch.equal(one, other)
    assert fp8_ops.absolute_maxima(x)[1:] == (None, None)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(256, 192), (100, 70)])
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("strided", [False, True])
def test_quantize_pair_kernel_equals_the_reference(fp8, shape, per_row, strided):
    """q and q_t bit for bit (saturated values included: the scales put the largest values of each row,
    or of the matrix, above the format's max) and the recorded amax, with one scale or the rows' and
    the columns' scales."""
    x = _matrix(shape, torch.bfloat16, strided)
    limit = torch.finfo(fp8).max
    if per_row:
        row_scale = limit / x.float().abs().amax(dim=1, keepdim=True) * 4
        column_scale = limit / x.float().abs().amax(dim=0) / 2
    else:
        row_scale = column_scale = limit / x.float().abs().amax() * 4
    records = [torch.tensor([0.5], device="cuda") for _ in range(2)]
    found = fp8_ops.quantize_pair(x, fp8, row_scale, column_scale, records[0][0])
    expected = fp8_ops.quantize_pair_reference(x, fp8, row_scale, column_scale, records[1][0])
    for one, other in zip(found, expected):
        assert one.dtype == fp8 and one.is_contiguous()
        assert torch.equal(one.view(torch.uint8), other.view(torch.uint8))
    assert torch.equal(records[0], records[1]) and records[0].item() == x.float().abs().max().item()
    assert (found[0].float().abs() == limit).any()  # saturation happened


def _amaxes(device):
    """Amaxes over many magnitudes, with the ones that get a scale of 1: 0, inf and nan."""
    values = torch.logspace(-30, 30, 2000, device=device) * torch.rand(2000, device=device)
    return torch.cat([values, torch.tensor([0.0, float("inf"), float("nan")], device=device)])


@pytest.mark.parametrize("margin", [0, 2])
def test_scales_from_amax_reference_gives_fp8s_scales_and_their_inverses(margin):
    from megatron.core.tensor_parallel.fp8 import scale_from_amax

    amax = _amaxes("cpu")
    scale, inverse = fp8_ops.scales_from_amax_reference(amax, 448.0, margin)
    assert torch.equal(scale, scale_from_amax(amax, torch.float8_e4m3fn, margin))
    assert torch.equal(inverse, 1 / scale) and (scale[-3:] == 1).all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("margin", [0, 2])
def test_scales_from_amax_kernel_equals_the_reference(margin):
    amax = _amaxes("cuda")
    for one, other in zip(fp8_ops.scales_from_amax(amax, 57344.0, margin),
                          fp8_ops.scales_from_amax_reference(amax, 57344.0, margin)):
        assert torch.equal(one, other)


@pytest.mark.parametrize("call, message", [
    (lambda: fp8_ops.absolute_maxima(torch.zeros(2, 3, 4)), r"2-d \[m, n\]"),
    (lambda: fp8_ops.quantize_pair(torch.zeros(2, 3), torch.bfloat16, torch.ones(()), torch.ones(())),
     "dtype must be one of"),
    (lambda: fp8_ops.quantize_pair(torch.zeros(2, 3), torch.float8_e4m3fn, torch.ones(3, 1), torch.ones(())),
     r"row_scale must be \[\] or \[2, 1\]"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises(FusedKernelArgumentError, match=message):
        call()
