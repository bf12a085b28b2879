"""When a fused kernel may run, and the one rule every fused op follows: the Triton kernel, or the reference.

A fast kernel runs when all of these hold, else the plain-torch reference (same math, same dtypes out):

- fused kernels are enabled: ``set_fused_kernels_enabled(True/False)`` overrides the environment
  variable ``MEGATRON_FUSED_KERNELS`` (``0``/``false``/``off`` disables; default on);
- every input tensor is on one CUDA device (CPU always runs the reference);
- the call is not being traced by ``torch.compile`` (inductor fuses the reference by itself);
- triton can be imported (if not, one warning saying what to install, then references);
- the kernel's own constraints hold (``training_ops``' ``*_constraint_violation``).

``fused_or_reference`` applies these rules; the Triton modules are imported on first use only.
"""
import importlib
import os
import warnings

import torch

ENV_VAR = "MEGATRON_FUSED_KERNELS"
FAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")
_enabled_override = None
_kernel_modules = {}


class FusedKernelArgumentError(ValueError):
    """A fused op (or MEGATRON_FUSED_KERNELS) got a value it cannot take; the message says which."""


def set_fused_kernels_enabled(enabled):
    """Use the fast kernels where they apply (True), never (False), or as the environment says (None)."""
    global _enabled_override
    if enabled is not None and not isinstance(enabled, bool):
        raise FusedKernelArgumentError(f"set_fused_kernels_enabled takes True, False or None, got {enabled!r}")
    _enabled_override = enabled


def fused_kernels_enabled():
    """Whether fast kernels may run: the override of set_fused_kernels_enabled, else MEGATRON_FUSED_KERNELS."""
    if _enabled_override is not None:
        return _enabled_override
    value = os.environ.get(ENV_VAR, "1").strip().lower()
    if value in _TRUE_WORDS:
        return True
    if value in _FALSE_WORDS:
        return False
    raise FusedKernelArgumentError(
        f"environment variable {ENV_VAR}={value!r}: expected one of {_TRUE_WORDS + _FALSE_WORDS}"
    )


def runtime_blocker(*tensors):
    """Why no fast kernel may run on ``tensors`` now (compiling, disabled, not CUDA), or None.

    The compiling case comes first, so that torch.compile traces no more of this than the check."""
    if torch.compiler.is_compiling():
        return "traced by torch.compile, which fuses the reference itself"
    if not fused_kernels_enabled():
        return f"fused kernels disabled ({ENV_VAR}=0 or set_fused_kernels_enabled(False))"
    return device_blocker(tensors)


def device_blocker(tensors):
    """Why ``tensors`` cannot go to a kernel by where they live (not CUDA, several devices), or None."""
    if not all(t.is_cuda for t in tensors):
        return "inputs are not all CUDA tensors"
    if len({t.device for t in tensors}) > 1:
        return "inputs are on different devices"
    return None


def dtype_violation(name, tensor):
    """Why ``tensor`` (called ``name`` in the message) has a dtype no kernel takes, or None."""
    if tensor.dtype not in FAST_DTYPES:
        return f"{name} has dtype {tensor.dtype}, the kernel takes {FAST_DTYPES}"
    return None


def kernel_module(module_name):
    """The Triton module ``fused_kernels.<module_name>``, or None (after one warning) without triton."""
    if module_name not in _kernel_modules:
        try:
            _kernel_modules[module_name] = importlib.import_module(f"megatron.core.fused_kernels.{module_name}")
        except ImportError as error:
            warnings.warn(f"fused kernels: {_import_problem(module_name, error)}; using the torch references")
            _kernel_modules[module_name] = None
    return _kernel_modules[module_name]


def _import_problem(module_name, error):
    """Why the Triton module could not be imported, with what to install when triton is missing."""
    if isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] == "triton":
        return ("triton is not installed (torch's CUDA builds ship it; otherwise `pip install triton`, "
                "the package's [triton] extra)")
    return f"{module_name} failed to import ({error})"


def fused_or_reference(module_name, tensors, violation, fused, reference):
    """``fused(kernels)`` with ``kernels`` the Triton module ``fused_kernels.<module_name>``, when a
    kernel may run on ``tensors`` (None entries skipped), ``violation()`` (the kernel's constraints)
    returns None and the module imports; else ``reference()``.

    The runtime test comes first: under torch.compile nothing past it is traced."""
    present = [t for t in tensors if t is not None]
    if runtime_blocker(*present) is None and violation() is None:
        kernels = kernel_module(module_name)
        if kernels is not None:
            return fused(kernels)
    return reference()


def check_hidden_vector(op, name, vector, hidden):
    """Raise FusedKernelArgumentError unless ``vector`` is None or has shape [hidden]."""
    if vector is not None and tuple(vector.shape) != (hidden,):
        raise FusedKernelArgumentError(f"{op}: {name} must have shape [{hidden}] (the last dim), got {tuple(vector.shape)}")
