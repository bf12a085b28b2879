"""The training ops (fused_kernels/training_ops.py) on CPU: the references exactly, autograd through
them, each kernel's constraints, bad arguments."""
import pytest
import torch

from megatron.core import fused_kernels
from megatron.core.fused_kernels import selection, training_ops
from megatron.core.fused_kernels.selection import FusedKernelArgumentError


def test_cpu_runs_the_references_exactly(monkeypatch):
    requested = {}
    monkeypatch.setattr(selection, "_kernel_modules", requested)
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
    assert torch.equal(fused_kernels.rms_norm(x, weight, 1e-6), fused_kernels.rms_norm_reference(x, weight, 1e-6))
    normed, same = fused_kernels.rms_norm(x, weight, 1e-6, return_input=True)
    assert torch.equal(normed, fused_kernels.rms_norm_reference(x, weight, 1e-6)) and same is x
    assert torch.equal(fused_kernels.bias_gelu(bias, x), fused_kernels.bias_gelu_reference(bias, x))
    residual = torch.randn(4, 2, 16)
    torch.manual_seed(1)
    fused = fused_kernels.bias_dropout_add(x, bias, residual, 0.1, True)
    torch.manual_seed(1)
    assert torch.equal(fused, fused_kernels.bias_dropout_add_reference(x, bias, residual, 0.1, True))
    assert requested == {}


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
    assert training_ops.softmax_constraint_violation(torch.empty(1, 1, 2, 8, dtype=torch.float16), None) is None
    too_long = torch.empty(1, 1, 1, training_ops.MAX_SOFTMAX_KEYS + 1, device="meta")
    assert "keys" in training_ops.softmax_constraint_violation(too_long, None)
    assert "float64" in training_ops.softmax_constraint_violation(torch.empty(1, 1, 2, 8, dtype=torch.float64), None)
    assert "empty" in training_ops.softmax_constraint_violation(torch.empty(0, 1, 2, 8), None)


def test_layer_norm_constraints():
    x, vector = torch.empty(4, 64, dtype=torch.bfloat16), torch.empty(64)
    assert training_ops.layer_norm_constraint_violation(x, vector, vector) is None  # fp32 weights with bf16 x
    wide = torch.empty(2, training_ops.MAX_LAYER_NORM_HIDDEN + 1, device="meta")
    assert "hidden size" in training_ops.layer_norm_constraint_violation(wide, vector, vector)
    assert "weight" in training_ops.layer_norm_constraint_violation(x, vector.double(), vector)
    assert training_ops.rms_norm_constraint_violation(x, vector) is None
    assert "hidden size" in training_ops.rms_norm_constraint_violation(wide, vector)
    assert "weight" in training_ops.rms_norm_constraint_violation(x, vector.double())
    assert "empty" in training_ops.rms_norm_constraint_violation(x[:0], vector)


def test_elementwise_constraints():
    y, bias = torch.empty(4, 64, dtype=torch.float16), torch.empty(64, dtype=torch.float16)
    assert training_ops.bias_gelu_constraint_violation(bias, y) is None
    assert "promote" in training_ops.bias_gelu_constraint_violation(bias.float(), y)
    huge = torch.empty(2**31, device="meta")
    assert "elements" in training_ops.bias_gelu_constraint_violation(torch.empty(1, device="meta"), huge)
    assert training_ops.bias_dropout_add_constraint_violation(y, None, y, 0.1) is None
    assert "residual" in training_ops.bias_dropout_add_constraint_violation(y, bias, y.float(), 0.1)
    assert "prob = 1" in training_ops.bias_dropout_add_constraint_violation(y, bias, y, 1.0)
    mixed = torch.empty(3, 2, 2 * 6 * 8, dtype=torch.bfloat16)
    assert training_ops.qkv_split_constraint_violation(mixed, None, 8, 4) is None
    assert "groups * 5 * 8" in training_ops.qkv_split_constraint_violation(mixed, None, 8, 3)


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
        (lambda: fused_kernels.rms_norm(torch.zeros(2, 8), torch.zeros(4), 1e-5), "weight must have shape"),
        (lambda: fused_kernels.rms_norm(torch.zeros(2, 8), None, 1e-5), "rms_norm: weight must be a tensor"),
        (lambda: fused_kernels.bias_gelu(torch.zeros(4), torch.zeros(2, 8)), "bias must have shape"),
        (lambda: fused_kernels.bias_dropout_add(torch.zeros(2, 8), None, torch.zeros(2, 4), 0.1, True), "residual"),
        (lambda: fused_kernels.split_query_key_value(torch.zeros(2, 1, 24), None, 4, 0), "queries_per_group"),
        (lambda: fused_kernels.split_query_key_value(torch.zeros(2, 1, 24), torch.zeros(12), 4, 4), "bias"),
        (lambda: fused_kernels.bias_dropout_add(torch.zeros(2, 8), None, torch.zeros(2, 8), 1.5, True), r"\[0, 1\]"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, message):
    with pytest.raises(FusedKernelArgumentError, match=message):
        call()


def test_adamw_step_bad_arguments():
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
