"""Host-side launch arithmetic shared by the Triton kernels (imports no triton).

Plain integer helpers: triton's own ``cdiv`` and ``next_power_of_2`` are constexpr-function objects
that cost microseconds per call on the host, which adds up at several calls per launch.
"""
import functools

import torch

# Programs per SM of the kernels that reduce over rows into per-program partial sums.
LAYER_NORM_PROGRAMS_PER_SM = 4
ELEMENTWISE_PROGRAMS_PER_SM = 16
_INTERPRETER_PROGRAMS = 4


def cdiv(a, b):
    """ceil(a / b) for positive integers."""
    return -(-a // b)


def next_power_of_2(n):
    """Smallest power of 2 >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _multiprocessors(device):
    return torch.cuda.get_device_properties(device).multi_processor_count


def reduction_programs(device, n_tiles, programs_per_sm):
    """Programs of a kernel that reduces over rows: ``programs_per_sm`` per SM, at most one per tile."""
    if device.type == "cuda":
        per_device = _multiprocessors(device) * programs_per_sm
    else:  # Triton's interpreter
        per_device = _INTERPRETER_PROGRAMS
    return max(1, min(per_device, n_tiles))
