"""GPU time of a call for the benchmark scripts: the median over repeats of CUDA events around it; and
the scripts' common check of their size flags."""
import argparse
import statistics

import torch


def median_ms(call, repeats: int, warmup: int = 1) -> float:
    """Median ms of ``call()`` over ``repeats`` runs after ``warmup`` untimed ones, each run timed by
    CUDA events on the current stream and waited for before the next."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def refuse_non_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """``parser.error`` naming the flags ``--name`` unless each of ``args``' ``names`` is at least 1."""
    values = [getattr(args, name) for name in names]
    if min(values) < 1:
        flags = " and ".join(f"--{name}" for name in names)
        parser.error(f"{flags} must be positive, got {' and '.join(map(str, values))}")
