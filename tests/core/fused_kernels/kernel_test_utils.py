"""Shared by the GPU kernel tests: make the references raise inside the public ops, so each public
call provably takes the fast path, and keep the originals for the comparisons."""
from types import SimpleNamespace

from megatron.core import fused_kernels


def forbidden(name):
    """A stand-in for ``name`` that fails the test when called."""

    def call(*args, **kwargs):
        raise AssertionError(f"{name} was called: the fast path was not taken")

    return call


def forbid_references(monkeypatch, module, names):
    """Replace ``module``'s references ``names`` by raising stand-ins (fused kernels switched on);
    returns the originals as attributes. Undo with ``fused_kernels.set_fused_kernels_enabled(None)``
    (monkeypatch restores the references)."""
    fused_kernels.set_fused_kernels_enabled(True)
    originals = SimpleNamespace(**{name: getattr(module, name) for name in names})
    for name in names:
        monkeypatch.setattr(module, name, forbidden(name))
    return originals
