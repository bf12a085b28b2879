"""The on/off switch, CPU always on the references, the missing-triton warning, and the one
kernel-or-reference rule (fused_kernels/selection.py)."""
import types
import warnings

import pytest
import torch

from megatron.core import fused_kernels
from megatron.core.fused_kernels import selection
from megatron.core.fused_kernels.selection import FusedKernelArgumentError


@pytest.fixture(autouse=True)
def _environment_default(monkeypatch):
    monkeypatch.delenv(selection.ENV_VAR, raising=False)
    selection.set_fused_kernels_enabled(None)
    yield
    selection.set_fused_kernels_enabled(None)


@pytest.mark.parametrize(
    "value, expected", [(None, True), ("1", True), ("true", True), ("ON", True), ("0", False), ("off", False), ("False", False)]
)
def test_environment_variable_switches_kernels(monkeypatch, value, expected):
    if value is not None:
        monkeypatch.setenv(selection.ENV_VAR, value)
    assert fused_kernels.fused_kernels_enabled() is expected


def test_bad_environment_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(selection.ENV_VAR, "maybe")
    with pytest.raises(FusedKernelArgumentError, match="MEGATRON_FUSED_KERNELS='maybe'"):
        fused_kernels.fused_kernels_enabled()


def test_function_overrides_environment_until_reset(monkeypatch):
    monkeypatch.setenv(selection.ENV_VAR, "1")
    fused_kernels.set_fused_kernels_enabled(False)
    assert not fused_kernels.fused_kernels_enabled()
    assert "disabled" in selection.runtime_blocker(torch.zeros(1))
    monkeypatch.setenv(selection.ENV_VAR, "0")
    fused_kernels.set_fused_kernels_enabled(True)
    assert fused_kernels.fused_kernels_enabled()
    fused_kernels.set_fused_kernels_enabled(None)
    assert not fused_kernels.fused_kernels_enabled()
    with pytest.raises(FusedKernelArgumentError, match="True, False or None"):
        fused_kernels.set_fused_kernels_enabled("yes")


def test_cpu_tensors_never_take_the_fast_path():
    assert selection.runtime_blocker(torch.zeros(2), torch.zeros(2)) == "inputs are not all CUDA tensors"


@pytest.mark.parametrize("error, expected", [
    (ModuleNotFoundError("No module named 'triton'", name="triton"), r"triton is not installed .*pip install triton"),
    (ModuleNotFoundError("No module named 'triton.language'", name="triton.language"), r"triton is not installed"),
    (ImportError("libcuda.so.1: cannot open shared object file"), r"triton_softmax failed to import \(libcuda"),
])
def test_missing_triton_warns_once(monkeypatch, error, expected):
    def failing_import(name):
        raise error

    monkeypatch.setattr(selection, "_kernel_modules", {})
    monkeypatch.setattr(selection, "importlib", types.SimpleNamespace(import_module=failing_import))
    with pytest.warns(UserWarning, match=expected):
        assert selection.kernel_module("triton_softmax") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert selection.kernel_module("triton_softmax") is None


def _choose(violation):
    return selection.fused_or_reference("triton_fake", (torch.zeros(2), None), lambda: violation,
                                        lambda kernels: ("fused", kernels.name), lambda: ("reference", None))


def test_fused_or_reference(monkeypatch):
    """The runtime rules, then the kernel's constraints, then the import: each one alone sends the
    call to the reference, and the module is imported only once the others hold."""
    imported = []

    def fake_import(name):
        imported.append(name)
        return types.SimpleNamespace(name=name)

    monkeypatch.setattr(selection, "_kernel_modules", {})
    monkeypatch.setattr(selection, "importlib", types.SimpleNamespace(import_module=fake_import))
    assert _choose(None) == ("reference", None) and imported == []  # CPU tensors
    monkeypatch.setattr(selection, "device_blocker", lambda tensors: None)  # as if on one CUDA device
    assert _choose("too wide") == ("reference", None) and imported == []
    assert _choose(None) == ("fused", "megatron.core.fused_kernels.triton_fake")
    assert imported == ["megatron.core.fused_kernels.triton_fake"]
    selection.set_fused_kernels_enabled(False)
    assert _choose(None) == ("reference", None)
    selection.set_fused_kernels_enabled(None)
    selection._kernel_modules["triton_fake"] = None  # triton missing
    assert _choose(None) == ("reference", None)
