"""FP8 quantization, the scaled GEMM and delayed scaling (megatron/core/tensor_parallel/fp8.py) on CPU,
against float64 computations of the same definitions."""
import pytest
import torch

from megatron.core.fused_kernels.fp8_ops import quantize_pair
from megatron.core.tensor_parallel import fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _fp8_grid(dtype):
    """Every finite non-negative value of the format, float64, ascending."""
    bits = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(dtype).double()
    return torch.unique(bits[torch.isfinite(bits) & (bits >= 0)])


def _nearest_on_grid(values, dtype):
    """Round-to-nearest onto the format's values (ties: either neighbour), saturated: float64 reference."""
    grid = _fp8_grid(dtype)
    magnitude = values.abs().clamp(max=grid[-1].item())
    index = torch.searchsorted(grid, magnitude).clamp(1, len(grid) - 1)
    below, above = grid[index - 1], grid[index]
    nearest = torch.where(magnitude - below <= above - magnitude, below, above)
    return torch.sign(values) * nearest, below, above


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("margin", [0, 2])
def test_quantize_rounds_to_the_nearest_fp8_value_and_saturates(dtype, margin):
    torch.manual_seed(0)
    x = torch.randn(64, 96) * torch.logspace(-3, 1, 96)  # columns of very different magnitudes
    x[0, :3] = torch.tensor([0.0, -1e9, 1e9])
    amax = torch.tensor(5.0)  # below the tensor's own: the largest values saturate
    operand = fp8.quantize_operand(x, dtype, margin, rowwise=False, amax=amax)
    scale = fp8.format_max(dtype) / (5.0 * 2.0 ** margin)
    assert operand.scale.item() == pytest.approx(scale, rel=1e-7)
    scaled = x.double() * operand.scale.double()
    expected, below, above = _nearest_on_grid(scaled, dtype)
    found = operand.data.double()
    magnitude = scaled.abs().clamp(max=fp8.format_max(dtype))
    tie = torch.isclose(magnitude - below, above - magnitude, rtol=1e-6)  # x s rounded in fp32 first
    assert torch.equal(torch.where(tie, expected, found), expected)
    assert found[0, 1] == -fp8.format_max(dtype) and found[0, 2] == fp8.format_max(dtype)


def test_scale_from_amax_edges():
    amax = torch.tensor([0.0, float("inf"), float("nan"), 448.0, 1.0])
    assert fp8.scale_from_amax(amax, E4M3, 0).tolist() == [1.0, 1.0, 1.0, 1.0, 448.0]
    assert fp8.scale_from_amax(amax, E4M3, 3).tolist()[3:] == [1.0 / 8, 56.0]


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3", "hybrid"])
def test_scaled_mm_is_the_product_of_the_dequantized_operands(rowwise, dtypes):
    """Emulated and torch._scaled_mm (CPU) both equal the float64 product of q_a / s_a and q_b / s_b,
    to fp32 accumulation and one rounding of the output."""
    torch.manual_seed(1)
    a_values, b_values = torch.randn(48, 80) * 3.0, torch.randn(32, 80) * 0.02
    a = fp8.quantize_operand(a_values, dtypes[0], 0, rowwise)
    b = fp8.quantize_operand(b_values, dtypes[1], 0, rowwise)
    expected = (a.data.double() / a.scale.double()).matmul((b.data.double() / b.scale.double()).t())
    for emulate in (True, False):
        for out_dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2 ** -8)):
            found = fp8.scaled_mm(a, b, out_dtype, emulate)
            assert found.dtype == out_dtype and found.shape == (48, 32)
            torch.testing.assert_close(found.double(), expected, rtol=tolerance, atol=tolerance * expected.abs().max())
    quantization_error = (expected - a_values.double().matmul(b_values.double().t())).abs().max()
    assert 0 < quantization_error < 0.1 * expected.abs().max()  # FP8 moved the result, a little


def _record(state, role, amax):
    """What a delayed-scaling quantization of a tensor with this amax records."""
    scale, _ = state.role_scale(role)
    quantize_pair(torch.tensor([[amax, -amax / 2]]), state.config.dtype(role), scale, scale,
                  record=state.amax_history[0, fp8.ROLES.index(role)])


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_scaling_history_scales_and_restore(algo):
    config = fp8.Fp8Config(recipe="delayed", amax_history_len=3, amax_compute_algo=algo, margin=1)
    state = fp8.DelayedScaling(config)
    assert state.scale.tolist() == [0.0, 0.0, 0.0] and not state.has_scales  # the first step scales itself
    steps = [(2.0, 0.5, 1e-3), (8.0, 0.25, 4e-3), (1.0, 0.125, 2e-3), (0.5, 0.0625, 1e-3)]
    for step, (x_amax, w_amax, g_amax) in enumerate(steps):
        for micro_batch in (0.5, 1.0):  # the step's maximum counts
            for role, amax in zip(fp8.ROLES, (x_amax * micro_batch, w_amax, g_amax * micro_batch)):
                _record(state, role, amax)
        before = state.scale.clone()
        recorded, used = state.end_step()
        assert recorded.tolist() == pytest.approx([x_amax, w_amax, g_amax])
        assert torch.equal(used, state.scale if step == 0 else before)
        window = steps[max(0, step - 2):step + 1] if algo == "max" else [steps[step]]
        amax = [max(values) for values in zip(*window)]
        expected = [448.0 / (amax[0] * 2), 448.0 / (amax[1] * 2), 57344.0 / (amax[2] * 2)]
        assert state.scale.tolist() == pytest.approx(expected, rel=1e-6)
        assert state.amax_history[0].tolist() == [0.0, 0.0, 0.0]
        assert torch.equal(torch.stack(state.inverses()), state.scale.reciprocal())
    restored = fp8.DelayedScaling(config)
    restored.load_state_dict(state.state_dict())
    assert torch.equal(restored.amax_history, state.amax_history) and torch.equal(restored.scale, state.scale)
    assert restored.has_scales and torch.equal(torch.stack(restored.inverses()), torch.stack(state.inverses()))
    assert not any(key.startswith("inverse") for key in state.state_dict())  # derived from the scales, not saved


def test_ending_several_layers_at_once_equals_ending_each_alone():
    """end_delayed_steps over three layers (one with scales from a step before, two fresh) gives each
    layer's own end_step: the same returned amaxes and scales, histories and new scales."""
    config = fp8.Fp8Config(recipe="delayed", amax_history_len=3, amax_compute_algo="max")
    together, alone = ([fp8.DelayedScaling(config) for _ in range(3)] for _ in range(2))
    for states in (together, alone):
        _record(states[0], "input", 3.0)
        states[0].end_step()
    generator = torch.Generator().manual_seed(0)
    for step in range(2):
        amaxes = torch.rand(3, 3, generator=generator) * 10 ** step
        for states in (together, alone):
            for state, row in zip(states, amaxes):
                for role, amax in zip(fp8.ROLES, row.tolist()):
                    _record(state, role, amax)
        recorded, used = fp8.end_delayed_steps(together, torch.stack([s.amax_history[0] for s in together]))
        for index, state in enumerate(alone):
            expected_recorded, expected_used = state.end_step()
            assert torch.equal(recorded[index], expected_recorded) and torch.equal(used[index], expected_used)
            assert torch.equal(together[index].amax_history, state.amax_history)
            assert torch.equal(together[index].scale, state.scale) and together[index].has_scales


def test_overflow_and_underflow_of_an_amax():
    scale = fp8.scale_from_amax(torch.tensor(2.0), E4M3, 0)
    assert fp8.saturated(torch.tensor(2.5), scale, E4M3) and not fp8.saturated(torch.tensor(2.0), scale, E4M3)
    assert fp8.underflowed(torch.tensor(1e-5), scale, E4M3) and not fp8.underflowed(torch.tensor(1e-3), scale, E4M3)


@pytest.mark.parametrize("settings, message", [(dict(format="e5m2"), "--fp8-format e5m2"),
                                               (dict(recipe="mxfp8"), "--fp8-recipe mxfp8"),
                                               (dict(amax_compute_algo="mean"), "--fp8-amax-compute-algo mean"),
                                               (dict(amax_history_len=0), "--fp8-amax-history-len 0"),
                                               (dict(margin=-1), "--fp8-margin -1")])
def test_bad_settings_name_the_flag(settings, message):
    with pytest.raises(fp8.Fp8ConfigError, match=message):
        fp8.Fp8Config(**settings)


def test_roles_take_their_format():
    assert fp8.Fp8Config(format="hybrid").dtype("grad_output") == E5M2
    assert fp8.Fp8Config(format="hybrid").dtype("input") == E4M3
    assert fp8.Fp8Config(format="e4m3").dtype("grad_output") == E4M3
