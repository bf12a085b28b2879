"""The decode ops (fused_kernels/decode_ops.py) on CPU: the references exactly, bad arguments, and what
torch.compile sees of them."""
import subprocess
import sys
import warnings

import pytest
import torch

from megatron.core import fused_kernels
from megatron.core.fused_kernels import decode_ops, selection
from megatron.core.fused_kernels.selection import FusedKernelArgumentError


def test_cpu_runs_the_references_exactly(monkeypatch):
    requested = {}
    monkeypatch.setattr(selection, "_kernel_modules", requested)
    torch.manual_seed(0)
    bias = torch.randn(16)
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
    grouped_query = torch.randn(1, 4, 1, 16)  # 4 heads over the cache's 2 groups
    written = keys.clone(), values.clone()
    assert torch.equal(fused_kernels.decode_attention(grouped_query, keys, values, position, None, 0.25, new_key,
                                                      new_value),
                       fused_kernels.decode_attention_reference(grouped_query, *written, position, None, 0.25,
                                                                new_key, new_value))
    residual = torch.randn(1, 1, 8, dtype=torch.bfloat16)
    assert torch.equal(fused_kernels.linear(row, matrix, bias[:8].bfloat16(), residual),
                       fused_kernels.linear_reference(row, matrix, bias[:8].bfloat16(), residual))
    norm = (torch.randn(16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16), 1e-5)
    assert torch.equal(fused_kernels.layer_norm_linear(row, *norm, matrix, None, "gelu"),
                       fused_kernels.layer_norm_linear_reference(row, *norm, matrix, None, "gelu"))
    rms = (norm[0], None, 1e-6)
    assert torch.equal(fused_kernels.layer_norm_linear(row, *rms, matrix, None, "swiglu", norm="rms"),
                       fused_kernels.layer_norm_linear_reference(row, *rms, matrix, None, "swiglu", "rms"))
    assert requested == {}


def test_grouped_query_with_rotary_on_cpu():
    """A query of the projection's grouped rows [b, g, q, 1, hn] and the rotary embedding (a third of
    the channels) give what the reshaped query after ``rotary_embedding_reference`` gives."""
    torch.manual_seed(1)
    batch, groups, queries, head_dim = 2, 2, 3, 12
    mixed = torch.randn(1, batch, groups, queries + 2, head_dim).to(torch.bfloat16)  # the projection's rows
    grouped = mixed.permute(1, 2, 3, 0, 4)  # [b, g, q + 2, 1, hn]
    query, key, value = grouped[:, :, :queries], grouped[:, :, queries], grouped[:, :, queries + 1]
    keys, values = torch.randn(2, batch, groups, 9, head_dim).to(torch.bfloat16)
    inv_freq, positions, where = 1.0 / 10000 ** (torch.arange(2) / 2), torch.tensor([7, 4]), torch.tensor([6])
    expected_cache = keys.clone(), values.clone()
    rotated_query, rotated_key = fused_kernels.rotary_embedding_reference(
        query.reshape(batch, groups * queries, 1, head_dim).permute(2, 0, 1, 3), key.permute(2, 0, 1, 3),
        positions[:, None], inv_freq)
    expected = fused_kernels.decode_attention_reference(rotated_query, *expected_cache, where, None, 0.5,
                                                        rotated_key, value)
    out = fused_kernels.decode_attention(query, keys, values, where, None, 0.5, key, value, (inv_freq, positions))
    assert torch.equal(out, expected)
    assert torch.equal(keys, expected_cache[0]) and torch.equal(values, expected_cache[1])
    assert not torch.equal(rotated_key, key)  # the rotation changed what the cache holds at p


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: fused_kernels.decode_attention(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8),
                                                torch.tensor([2]), None, 1.0), r"\[b, np, 1, hn\]"),
        (lambda: fused_kernels.decode_attention(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8),
                                                torch.tensor([2, 3]), None, 1.0), "one int64 element"),
        (lambda: fused_kernels.decode_attention(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8),
                                                torch.tensor([2]), None, 1.0, torch.zeros(1, 2, 1, 8)), "come together"),
        (lambda: fused_kernels.decode_attention(torch.zeros(1, 3, 1, 8), torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8),
                                                torch.tensor([2]), None, 1.0), "g dividing np"),
        (lambda: fused_kernels.decode_attention(torch.zeros(1, 4, 1, 8), torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8),
                                                torch.tensor([2]), None, 1.0, *torch.zeros(2, 1, 4, 1, 8)),
         r"shaped \(1, 2, 1, 8\) \(\[b, g, 1, hn\]\)"),
        (lambda: fused_kernels.decode_attention(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8),
                                                torch.tensor([2]), None, 1.0, *torch.zeros(2, 1, 2, 1, 8),
                                                (torch.ones(5), torch.tensor([2]))), r"d <= hn"),
        (lambda: fused_kernels.decode_attention(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8),
                                                torch.tensor([2]), None, 1.0, None, None,
                                                (torch.ones(2), torch.tensor([2]))), "needs new_key"),
        (lambda: fused_kernels.linear(torch.zeros(1, 8), torch.zeros(4, 8), None, torch.zeros(1, 8)), "residual"),
        (lambda: fused_kernels.layer_norm_linear(torch.zeros(1, 8), torch.ones(8), torch.zeros(8), 1e-5,
                                                 torch.zeros(4, 8), None, "relu"), "activation must be one of"),
        (lambda: fused_kernels.layer_norm_linear(torch.zeros(1, 8), torch.ones(4), torch.zeros(8), 1e-5,
                                                 torch.zeros(4, 8)), "norm_weight must have shape"),
        (lambda: fused_kernels.layer_norm_linear(torch.zeros(1, 8), torch.ones(8), None, 1e-5, torch.zeros(4, 8),
                                                 norm="batch"), "norm must be one of"),
        (lambda: fused_kernels.layer_norm_linear(torch.zeros(1, 8), torch.ones(8), torch.zeros(8), 1e-5,
                                                 torch.zeros(4, 8), norm="rms"), "'rms' takes no norm_bias"),
        (lambda: fused_kernels.layer_norm_linear(torch.zeros(1, 8), torch.ones(8), None, 1e-5, torch.zeros(4, 8)),
         r"'layer' takes a norm_bias \[K\]"),
        (lambda: fused_kernels.layer_norm_linear(torch.zeros(1, 8), torch.ones(8), None, 1e-5, torch.zeros(5, 8),
                                                 None, "swiglu", norm="rms"), "even number of weight rows"),
        (lambda: fused_kernels.layer_norm_linear(torch.zeros(1, 8), torch.ones(8), None, 1e-5, torch.zeros(4, 8),
                                                 torch.zeros(2), norm="rms"), "bias must have shape"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, message):
    with pytest.raises(FusedKernelArgumentError, match=message):
        call()


def test_availability_constant_under_compile(monkeypatch):
    """decode_ops marks it as torch.compiler.assume_constant_result does (without importing torch._dynamo
    at import time): traced with nothing cached, dynamo calls it once instead of tracing the import."""
    assert getattr(torch.compiler.assume_constant_result(lambda: 1), decode_ops.CONSTANT_RESULT_MARKER) is True
    monkeypatch.setattr(selection, "_kernel_modules", {})

    def step(x):
        return x + 1 if decode_ops._decode_kernels_available() else x - 1

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no triton on CPU machines: the one warning saying so
        compiled = torch.compile(step, fullgraph=True, backend="eager")(torch.zeros(2))
    assert torch.equal(compiled, step(torch.zeros(2)))


def test_import_leaves_torch_dynamo_out():
    """torch._dynamo takes seconds to import; every process of a run imports the fused kernels."""
    code = "import sys, megatron.core.fused_kernels; print('torch._dynamo' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() \
        == "False"
