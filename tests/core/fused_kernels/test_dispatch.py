"""Dispatch rules: the on/off switch, CPU always on the references, kernel constraints, bad arguments."""
import subprocess
import sys
import types
import warnings

import pytest
import torch

from megatron.core import fused_kernels
from megatron.core.fused_kernels import dispatch
from megatron.core.fused_kernels.dispatch import FusedKernelArgumentError


@pytest.fixture(autouse=True)
def _environment_default(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    dispatch.set_fused_kernels_enabled(None)
    yield
    dispatch.set_fused_kernels_enabled(None)


@pytest.mark.parametrize(
    "value, expected", [(None, True), ("1", True), ("true", True), ("ON", True), ("0", False), ("off", False), ("False", False)]
)
def test_environment_variable_switches_kernels(monkeypatch, value, expected):
    if value is not None:
        monkeypatch.setenv(dispatch.ENV_VAR, value)
    assert fused_kernels.fused_kernels_enabled() is expected


def test_bad_environment_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "maybe")
    with pytest.raises(FusedKernelArgumentError, match="MEGATRON_FUSED_KERNELS='maybe'"):
        fused_kernels.fused_kernels_enabled()


def test_function_overrides_environment_until_reset(monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "1")
    fused_kernels.set_fused_kernels_enabled(False)
    assert not fused_kernels.fused_kernels_enabled()
    assert "disabled" in dispatch.runtime_blocker(torch.zeros(1))
    monkeypatch.setenv(dispatch.ENV_VAR, "0")
    fused_kernels.set_fused_kernels_enabled(True)
    assert fused_kernels.fused_kernels_enabled()
    fused_kernels.set_fused_kernels_enabled(None)
    assert not fused_kernels.fused_kernels_enabled()
    with pytest.raises(FusedKernelArgumentError, match="True, False or None"):
        fused_kernels.set_fused_kernels_enabled("yes")


def test_cpu_tensors_never_take_the_fast_path():
    assert dispatch.runtime_blocker(torch.zeros(2), torch.zeros(2)) == "inputs are not all CUDA tensors"


def test_cpu_calls_return_the_references_exactly_and_never_ask_for_triton(monkeypatch):
    requested = {}
    monkeypatch.setattr(dispatch, "_kernel_modules", requested)
    torch.manual_seed(0)
    scores = torch.randn(2, 3, 8, 8, dtype=torch.bfloat16)
    mask = torch.rand(2, 1, 8, 8) < 0.3
    assert torch.equal(
        fused_kernels.scale_mask_softmax(scores, mask, 0.5, True, True),
        fused_kernels.scale_mask_softmax_reference(scores, mask, 0.5, True, True),
    )
    x, weight, bias = torch.randn(4, 2, 16), torch.randn(16), torch.randn(16)
    assert torch.equal(fused_kernels.layer_norm(x, weight, bias, 1e-5), fused_kernels.layer_norm_reference(x, weight, bias, 1e-5))
    normed, same = fused_kernels.layer_norm(x, weight, bias, 1e-5, return_input=True)
    assert torch.equal(normed, fused_kernels.layer_norm_reference(x, weight, bias, 1e-5)) and same is x
    assert torch.equal(fused_kernels.bias_gelu(bias, x), fused_kernels.bias_gelu_reference(bias, x))
    residual = torch.randn(4, 2, 16)
    torch.manual_seed(1)
    fused = fused_kernels.bias_dropout_add(x, bias, residual, 0.1, True)
    torch.manual_seed(1)
    assert torch.equal(fused, fused_kernels.bias_dropout_add_reference(x, bias, residual, 0.1, True))
    row, matrix = torch.randn(1, 1, 16, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16)
    assert torch.equal(fused_kernels.linear(row, matrix, bias[:8].bfloat16()),
                       torch.nn.functional.linear(row, matrix, bias[:8].bfloat16()))
    query, keys, values = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    position = torch.tensor([5])
    assert torch.equal(fused_kernels.decode_attention(query, keys, values, position, None, 0.25),
                       fused_kernels.decode_attention_reference(query, keys, values, position, None, 0.25))
    new_key, new_value = torch.randn(2, 1, 2, 1, 16)
    written = keys.clone(), values.clone()
    assert torch.equal(fused_kernels.decode_attention(query, keys, values, position, None, 0.25, new_key, new_value),
                       fused_kernels.decode_attention_reference(query, *written, position, None, 0.25, new_key, new_value))
    assert torch.equal(keys, written[0]) and torch.equal(values, written[1])
    residual = torch.randn(1, 1, 8, dtype=torch.bfloat16)
    assert torch.equal(fused_kernels.linear(row, matrix, bias[:8].bfloat16(), residual),
                       fused_kernels.linear_reference(row, matrix, bias[:8].bfloat16(), residual))
    norm = (torch.randn(16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16), 1e-5)
    assert torch.equal(fused_kernels.layer_norm_linear(row, *norm, matrix, None, "gelu"),
                       fused_kernels.layer_norm_linear_reference(row, *norm, matrix, None, "gelu"))
    assert requested == {}


@pytest.mark.parametrize("error, expected", [
    (ModuleNotFoundError("No module named 'triton'", name="triton"), r"triton is not installed .*pip install triton"),
    (ModuleNotFoundError("No module named 'triton.language'", name="triton.language"), r"triton is not installed"),
    (ImportError("libcuda.so.1: cannot open shared object file"), r"triton_softmax failed to import \(libcuda"),
])
def test_missing_triton_warns_once_with_what_to_install(monkeypatch, error, expected):
    def failing_import(name):
        raise error

    monkeypatch.setattr(dispatch, "_kernel_modules", {})
    monkeypatch.setattr(dispatch, "importlib", types.SimpleNamespace(import_module=failing_import))
    with pytest.warns(UserWarning, match=expected):
        assert dispatch.kernel_module("triton_softmax") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch.kernel_module("triton_softmax") is None


def test_cpu_autograd_flows_through_the_public_ops():
    torch.manual_seed(2)
    x = torch.randn(3, 2, 8, requires_grad=True)
    weight = torch.randn(8, requires_grad=True)
    bias = torch.randn(8, requires_grad=True)
    y = fused_kernels.layer_norm(x, weight, bias, 1e-5)
    y = fused_kernels.bias_dropout_add(fused_kernels.bias_gelu(bias, y), bias, x, 0.0, True)
    y.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (x, weight, bias))


def test_softmax_constraints():
    assert dispatch.softmax_constraint_violation(torch.empty(1, 1, 2, 8, dtype=torch.float16), None) is None
    too_long = torch.empty(1, 1, 1, dispatch.MAX_SOFTMAX_KEYS + 1, device="meta")
    assert "keys" in dispatch.softmax_constraint_violation(too_long, None)
    assert "float64" in dispatch.softmax_constraint_violation(torch.empty(1, 1, 2, 8, dtype=torch.float64), None)
    assert "empty" in dispatch.softmax_constraint_violation(torch.empty(0, 1, 2, 8), None)


def test_layer_norm_constraints():
    x, vector = torch.empty(4, 64, dtype=torch.bfloat16), torch.empty(64)
    assert dispatch.layer_norm_constraint_violation(x, vector, vector) is None  # fp32 weights with bf16 x
    wide = torch.empty(2, dispatch.MAX_LAYER_NORM_HIDDEN + 1, device="meta")
    assert "hidden size" in dispatch.layer_norm_constraint_violation(wide, vector, vector)
    assert "weight" in dispatch.layer_norm_constraint_violation(x, vector.double(), vector)


def test_elementwise_constraints():
    y, bias = torch.empty(4, 64, dtype=torch.float16), torch.empty(64, dtype=torch.float16)
    assert dispatch.bias_gelu_constraint_violation(bias, y) is None
    assert "promote" in dispatch.bias_gelu_constraint_violation(bias.float(), y)
    huge = torch.empty(2**31, device="meta")
    assert "elements" in dispatch.bias_gelu_constraint_violation(torch.empty(1, device="meta"), huge)
    assert dispatch.bias_dropout_add_constraint_violation(y, None, y, 0.1) is None
    assert "residual" in dispatch.bias_dropout_add_constraint_violation(y, bias, y.float(), 0.1)
    assert "prob = 1" in dispatch.bias_dropout_add_constraint_violation(y, bias, y, 1.0)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: fused_kernels.scale_mask_softmax(torch.zeros(2, 8, 8), None, 1.0, False, True), r"\[b, np, sq, sk\]"),
        (lambda: fused_kernels.scale_mask_softmax(torch.zeros(1, 1, 8, 8), torch.zeros(8, 8), 1.0, False, True), "bool"),
        (
            lambda: fused_kernels.scale_mask_softmax(torch.zeros(1, 1, 8, 8), torch.zeros(3, 8, dtype=torch.bool), 1.0, False, True),
            "does not broadcast",
        ),
        (lambda: fused_kernels.scale_mask_softmax(torch.zeros(1, 1, 8, 4), None, 1.0, True, True), "sq <= sk"),
        (lambda: fused_kernels.layer_norm(torch.zeros(2, 8), torch.zeros(4), torch.zeros(8), 1e-5), "weight must have shape"),
        (lambda: fused_kernels.bias_gelu(torch.zeros(4), torch.zeros(2, 8)), "bias must have shape"),
        (lambda: fused_kernels.bias_dropout_add(torch.zeros(2, 8), None, torch.zeros(2, 4), 0.1, True), "residual"),
        (lambda: fused_kernels.bias_dropout_add(torch.zeros(2, 8), None, torch.zeros(2, 8), 1.5, True), r"\[0, 1\]"),
        (lambda: fused_kernels.decode_attention(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8),
                                                torch.tensor([2]), None, 1.0), r"\[b, np, 1, hn\]"),
        (lambda: fused_kernels.decode_attention(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8),
                                                torch.tensor([2, 3]), None, 1.0), "one int64 element"),
        (lambda: fused_kernels.decode_attention(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8),
                                                torch.tensor([2]), None, 1.0, torch.zeros(1, 2, 1, 8)), "come together"),
        (lambda: fused_kernels.linear(torch.zeros(1, 8), torch.zeros(4, 8), None, torch.zeros(1, 8)), "residual"),
        (lambda: fused_kernels.layer_norm_linear(torch.zeros(1, 8), torch.ones(8), torch.zeros(8), 1e-5,
                                                 torch.zeros(4, 8), None, "relu"), "activation must be one of"),
        (lambda: fused_kernels.layer_norm_linear(torch.zeros(1, 8), torch.ones(4), torch.zeros(8), 1e-5,
                                                 torch.zeros(4, 8)), "norm_weight must have shape"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, message):
    with pytest.raises(FusedKernelArgumentError, match=message):
        call()


def test_the_decode_kernels_availability_is_a_constant_for_torch_compile(monkeypatch):
    """dispatch marks it as torch.compiler.assume_constant_result does (without importing torch._dynamo
    at import time): traced with nothing cached, dynamo calls it once instead of tracing the import."""
    assert getattr(torch.compiler.assume_constant_result(lambda: 1), dispatch.CONSTANT_RESULT_MARKER) is True
    monkeypatch.setattr(dispatch, "_kernel_modules", {})

    def step(x):
        return x + 1 if dispatch._decode_kernels_available() else x - 1

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no triton on CPU machines: the one warning saying so
        compiled = torch.compile(step, fullgraph=True, backend="eager")(torch.zeros(2))
    assert torch.equal(compiled, step(torch.zeros(2)))


def test_importing_the_fused_kernels_does_not_import_torch_dynamo():
    """torch._dynamo takes seconds to import; every process of a run imports the fused kernels."""
    code = "import sys, megatron.core.fused_kernels; print('torch._dynamo' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() \
        == "False"


def test_adamw_step_rejects_mismatched_shapes_and_non_fp32_state():
    param, step = torch.zeros(8), torch.ones(())
    settings = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
    with pytest.raises(FusedKernelArgumentError, match=r"adamw_step: exp_avg \(7,\) != param \(8,\)"):
        fused_kernels.adamw_step(param, torch.zeros(8), torch.zeros(7), torch.zeros(8), step, **settings)
    with pytest.raises(FusedKernelArgumentError, match="adamw_step: grad must be fp32, got torch.bfloat16"):
        fused_kernels.adamw_step(param, torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8), torch.zeros(8), step,
                                 **settings)
    with pytest.raises(FusedKernelArgumentError, match=r"adamw_step: param_copy \(4,\) != param \(8,\)"):
        fused_kernels.adamw_step(param, torch.zeros(8), torch.zeros(8), torch.zeros(8), step,
                                 param_copy=torch.zeros(4, dtype=torch.bfloat16), **settings)
