"""The bf16 matmul peak that MFU divides by, measured in the run on its own GPU."""
import math

import torch


def measure_matmul_peak_tflops(device, size: int = 8192, warmup: int = 10, repeats: int = 20,
                               trials: int = 5) -> float | None:
    """Best TFLOP/s of a ``size``³ bf16 matmul on a CUDA ``device`` (2·size³ FLOPs each); None on CPU.

    ``warmup`` products first, then ``trials`` timings of ``repeats`` back-to-back products between
    CUDA events; the best trial is the peak. The operands come from a private generator, so the
    training RNG streams are untouched.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=generator)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=generator)
    out = torch.empty(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(warmup):
        torch.matmul(a, b, out=out)
    torch.cuda.synchronize(device)
    best_seconds = math.inf
    for _ in range(trials):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            torch.matmul(a, b, out=out)
        end.record()
        end.synchronize()
        best_seconds = min(best_seconds, start.elapsed_time(end) / 1000.0)
    return 2.0 * size ** 3 * repeats / best_seconds / 1e12
