"""The parallel linear layers with FP8 GEMMs (fp8_linear.py) in the CPU emulation: each GEMM against
the float64 product of the dequantized operands, the main_grad path, and TP = 2 against TP = 1."""
import functools

import pytest
import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel import fp8, fp8_linear
from megatron.core.tensor_parallel.fp8_linear import end_fp8_step
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from tests.core.tensor_parallel.test_layers import _chunk, _gather, _master_weight, _randn
from tests.dist_utils import run_distributed

IN, OUT, SEQ, BATCH, SEED = 32, 48, 8, 2, 1234
init_normal = functools.partial(torch.nn.init.normal_, mean=0.0, std=0.5)
RECIPES = ["tensorwise", "rowwise", "delayed"]


def _config(recipe, **settings):
    return fp8.Fp8Config(format="hybrid", recipe=recipe, emulate=True, **settings)


def _dequantized(x, dtype, rowwise, scale=None):
    """float64 q / s of x [r, c] quantized with ``scale`` or its own (per row when ``rowwise``) amax's."""
    if scale is None:
        amax = x.abs().amax(dim=-1, keepdim=True) if rowwise else x.abs().amax()
        scale = fp8.scale_from_amax(amax.float(), dtype, 0)
    return fp8.quantize(x, scale, dtype).double() / scale.double()


def _expected(recipe, x, weight, grad_y, scales=None):
    """float64 Y = X W^T, dX = dY W, dW = dY^T X of the quantized operands, as the recipe quantizes
    them (delayed: with the given per-role scales)."""
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    rows = recipe == "rowwise"
    if recipe == "delayed":
        x_q, w_q, g_q = (_dequantized(t, dtype, False, scale)
                         for t, dtype, scale in zip((x, weight, grad_y), (e4m3, e4m3, e5m2), scales))
        return x_q @ w_q.t(), g_q @ w_q, g_q.t() @ x_q
    y = _dequantized(x, e4m3, rows) @ _dequantized(weight, e4m3, rows).t()
    if rows:  # each backward GEMM's operands scaled per row over its own contraction
        grad_x = _dequantized(grad_y, e5m2, True) @ _dequantized(weight.t(), e4m3, True).t()
        grad_w = _dequantized(grad_y.t(), e5m2, True) @ _dequantized(x.t(), e4m3, True).t()
    else:
        g_q, x_q, w_q = _dequantized(grad_y, e5m2, False), _dequantized(x, e4m3, False), _dequantized(weight, e4m3, False)
        grad_x, grad_w = g_q @ w_q, g_q.t() @ x_q
    return y, grad_x, grad_w


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_linear_is_the_product_of_the_quantized_operands(recipe):
    torch.manual_seed(SEED)
    layer = ColumnParallelLinear(IN, OUT, tp_group=None, init_method=init_normal, use_cpu_initialization=True,
                                 fp8=_config(recipe))
    scales = torch.tensor([100.0, 300.0, 9000.0])
    if recipe == "delayed":
        state = layer.fp8_gemms.delayed
        state.load_state_dict({"amax_history": state.amax_history, "scale": scales})
    x, grad_y = _randn(SEQ, BATCH, IN, seed=1) * 2.0, _randn(SEQ, BATCH, OUT, seed=2) * 0.01
    leaf = x.clone().requires_grad_(True)
    y, _ = layer(leaf)
    y.backward(grad_y)
    expected = _expected(recipe, x.reshape(-1, IN), layer.weight.detach(), grad_y.reshape(-1, OUT), scales)
    for found, wanted in zip((y.detach(), leaf.grad, layer.weight.grad), expected):
        wanted = wanted.reshape(found.shape)
        torch.testing.assert_close(found.double(), wanted, rtol=1e-5, atol=1e-5 * wanted.abs().max().item())
    torch.testing.assert_close(layer.bias.grad, grad_y.sum(dim=(0, 1)))
    exact = F.linear(x, layer.weight.detach(), layer.bias.detach())
    assert 0 < (y.detach() - exact).norm() < 0.1 * exact.norm()  # quantized, not the fp32 product
    if recipe == "delayed":  # this step's amaxes recorded for the scales of the next
        history = layer.fp8_gemms.delayed.amax_history[0]
        assert history.tolist() == pytest.approx([x.abs().max().item(), layer.weight.abs().max().item(),
                                                  grad_y.abs().max().item()])


def test_fp8_weight_gradient_goes_into_main_grad():
    torch.manual_seed(SEED)
    layers = [RowParallelLinear(IN, OUT, tp_group=None, init_method=init_normal, use_cpu_initialization=True,
                                fp8=_config("tensorwise"))
              for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    layers[1].weight.main_grad = torch.full(layers[1].weight.shape, 0.5)
    x, grad_y = _randn(SEQ, BATCH, IN, seed=3), _randn(SEQ, BATCH, OUT, seed=4)
    for layer in layers:
        layer(x)[0].backward(grad_y)
    assert layers[1].weight.grad is None
    torch.testing.assert_close(layers[1].weight.main_grad - 0.5, layers[0].weight.grad)


def _fp8_pair(group, recipe, sequence_parallel, comm_overlap=False):
    torch.manual_seed(SEED)
    column = ColumnParallelLinear(IN, OUT, tp_group=group, init_method=init_normal, use_cpu_initialization=True,
                                  sequence_parallel=sequence_parallel, comm_overlap=comm_overlap, fp8=_config(recipe))
    torch.manual_seed(SEED)
    row = RowParallelLinear(OUT, IN, tp_group=group, init_method=init_normal, use_cpu_initialization=True,
                            sequence_parallel=sequence_parallel, comm_overlap=comm_overlap, fp8=_config(recipe))
    return column, row


def _pair_step(column, row, x, grad_y, group, k, rank, split):
    """One forward and backward of column -> GeLU -> row: (Y, dX, dW_column, dW_row) gathered whole."""
    leaf = (_chunk(x, 0, k, rank) if split else x).clone().requires_grad_(True)
    y = row(F.gelu(column(leaf)[0]))[0]
    y.backward(_chunk(grad_y, 0, k, rank) if split else grad_y)
    grad_x = _gather(leaf.grad, 0, group) if split else leaf.grad
    y = _gather(y.detach(), 0, group) if split else y.detach()
    return y, grad_x, _gather(column.weight.grad, 0, group), _gather(row.weight.grad, 1, group)


def _gemms_check_their_inverse_scales():
    """Every operand that reaches an FP8 GEMM carries 1 / s exactly: the CPU emulation multiplies by
    the scales, the GPU's _scaled_mm by these inverses, so a wrong one would only show on a GPU."""
    original = fp8_linear.scaled_mm

    def checked(a, b, *args, **kwargs):
        for operand in (a, b):
            assert operand.inverse is not None and torch.equal(operand.inverse, operand.scale.reciprocal())
        return original(a, b, *args, **kwargs)

    fp8_linear.scaled_mm = checked


def _check_tp2_equals_tp1(rank, world_size, recipe, sequence_parallel, comm_overlap=False):
    """Column- then row-parallel FP8 layers at TP = 2 give TP = 1's output and gradients, step after
    step: the amaxes of split tensors are reduced over the group (delayed scaling: when the step
    ends), so both quantize with the same scales. With ``comm_overlap`` the TP = 2 layers quantize
    block by block of the sequence, as --tp-comm-overlap's pipelined collectives hand them over.
    Each GEMM's operands are checked to carry their exact inverse scales."""
    import torch.distributed as dist
    _gemms_check_their_inverse_scales()
    group = dist.new_group([0, 1])
    steps = 3 if recipe == "delayed" else 1
    inputs = [(_randn(SEQ, BATCH, IN, seed=5 + step) * (step + 1), _randn(SEQ, BATCH, IN, seed=50 + step) * 0.01)
              for step in range(steps)]
    results = []
    for tp_group, k in ((None, 1), (group, 2)):
        split = sequence_parallel and k > 1
        column, row = _fp8_pair(tp_group, recipe, split, comm_overlap and split)
        assert torch.equal(_gather(column.weight.detach(), 0, tp_group), _master_weight((OUT, IN)))
        for x, grad_y in inputs:
            column.zero_grad()
            row.zero_grad()
            results.append(_pair_step(column, row, x, grad_y, tp_group, k, rank, split))
            end_fp8_step(torch.nn.ModuleList([column, row]), [tp_group])
    for one, two in zip(results[:steps], results[steps:]):
        for expected, found in zip(one, two):
            torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("sequence_parallel, comm_overlap", [(False, False), (True, False), (True, True)],
                         ids=["tp", "tp-sp", "tp-sp-overlap"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_tp2_equals_tp1_under_fp8(recipe, sequence_parallel, comm_overlap):
    run_distributed(_check_tp2_equals_tp1, 2, recipe, sequence_parallel, comm_overlap)


def test_delayed_scaling_resumes_exactly_from_the_saved_state():
    """Three steps straight, or two, the layers' state saved and loaded into fresh layers, then the
    third: the same outputs and gradients bit for bit (the scales and histories are in the state dict)."""
    inputs = [(_randn(SEQ, BATCH, IN, seed=60 + step) * (step + 1), _randn(SEQ, BATCH, IN, seed=70 + step) * 0.01)
              for step in range(3)]

    def run(pair, steps):
        out = []
        for x, grad_y in steps:
            for layer in pair:
                layer.zero_grad()
            out.append(_pair_step(*pair, x, grad_y, None, 1, 0, False))
            counts = end_fp8_step(torch.nn.ModuleList(pair), [None])
        return out, counts

    straight, _ = run(_fp8_pair(None, "delayed", False), inputs)
    first = _fp8_pair(None, "delayed", False)
    run(first, inputs[:2])
    resumed = _fp8_pair(None, "delayed", False)
    for source, target in zip(first, resumed):
        assert "fp8_gemms.delayed.amax_history" in source.state_dict()
        target.load_state_dict(source.state_dict())
    last, counts = run(resumed, inputs[2:])
    for expected, found in zip(straight[2], last[0]):
        assert torch.equal(found, expected)
    assert counts.overflows.item() >= 1  # the input grew 3x over the step before: its amax saturated


def test_delayed_scaling_first_step_quantizes_with_current_amaxes():
    """Before a step has ended there are no delayed scales: the layers quantize as tensorwise does
    (gradients of 1e-7, which scales of 1 would flush to 0 in e5m2, keep their values) while recording
    the amaxes; that step's end counts nothing overflowed or underflowed. A state loaded from such a
    layer starts the same way, one loaded after a step uses its scales."""
    x, grad_y = _randn(SEQ, BATCH, IN, seed=90), _randn(SEQ, BATCH, IN, seed=91) * 1e-7
    delayed = _fp8_pair(None, "delayed", False)
    never_stepped = [{key: value.clone() for key, value in layer.state_dict().items()} for layer in delayed]
    first = _pair_step(*delayed, x, grad_y, None, 1, 0, False)
    expected = _pair_step(*_fp8_pair(None, "tensorwise", False), x, grad_y, None, 1, 0, False)
    for found, wanted in zip(first, expected):
        assert torch.equal(found, wanted)
    assert first[1].abs().min() > 0
    recorded = [layer.fp8_gemms.delayed.amax_history[0].clone() for layer in delayed]
    assert all((amaxes > 0).all() for amaxes in recorded)
    counts = end_fp8_step(torch.nn.ModuleList(delayed), [None])
    assert counts.overflows.item() == 0 and counts.underflows.item() == 0
    for layer, amaxes, saved in zip(delayed, recorded, never_stepped):
        state = layer.fp8_gemms.delayed
        dtypes = [state.config.dtype(role) for role in fp8.ROLES]
        assert state.has_scales and state.scale.tolist() == [fp8.scale_from_amax(a, d, 0).item()
                                                             for a, d in zip(amaxes, dtypes)]
        fresh = _fp8_pair(None, "delayed", False)[0 if layer is delayed[0] else 1]
        fresh.load_state_dict(layer.state_dict())
        assert fresh.fp8_gemms.delayed.has_scales
        fresh.load_state_dict(saved)
        assert not fresh.fp8_gemms.delayed.has_scales


def test_weight_is_quantized_once_per_step(monkeypatch):
    """The micro-batches of a step share the weight's FP8 copies; end_fp8_step (after the optimizer
    step) and a load of the layer's state make the next forward quantize the new weight."""
    from megatron.core.tensor_parallel import fp8_linear
    quantized = []
    original = fp8_linear.quantize_pair
    monkeypatch.setattr(fp8_linear, "quantize_pair", lambda x, *rest: quantized.append(x) or original(x, *rest))
    column = _fp8_pair(None, "tensorwise", False)[0]
    x, grad_y = _randn(SEQ, BATCH, IN, seed=80), _randn(SEQ, BATCH, OUT, seed=81)

    def weight_quantizations():
        return sum(t is column.weight for t in quantized)

    for _ in range(2):
        column(x)[0].backward(grad_y)
    assert weight_quantizations() == 1
    with torch.no_grad():
        column.weight.mul_(2.0)
    end_fp8_step(column, [None])
    doubled = column(x)[0].detach()
    assert weight_quantizations() == 2
    fresh = _fp8_pair(None, "tensorwise", False)[0]
    fresh.load_state_dict(column.state_dict())
    assert torch.equal(fresh(x)[0].detach(), doubled)
    fresh(x)
    column.load_state_dict(fresh.state_dict())
    column(x)
    assert weight_quantizations() == 3
