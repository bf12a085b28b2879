"""Bandwidth of the tensor-parallel collectives at the trainer's message sizes.

    torchrun --nproc_per_node 2 tools/benchmarks/bench_collectives.py [--sizes-mb 16 32 64 128]
    NCCL_PROTO=Simple torchrun --nproc_per_node 2 tools/benchmarks/bench_collectives.py

TP=2 of the 1.3B GPT at micro-batch 8 all-reduces 64 MB activations (s·b·h bf16), and sequence
parallelism all-gathers and reduce-scatters the same 64 MB. Each row is one collective of the
library's (megatron.core.tensor_parallel.utils) on a buffer of the given size in bf16 over all
ranks: its result is checked once, then the mean time of ``--iterations`` calls after 5 warm-up
calls, the algorithm bandwidth (bytes / time) and the bus bandwidth, NCCL's figure for comparing
collectives (all-reduce x 2(n-1)/n, all-gather and reduce-scatter x (n-1)/n of the full buffer).
NCCL on GPUs, gloo on CPU. Rank 0 prints a markdown table headed by the NCCL variables set.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.tensor_parallel.utils import (all_gather_along_first_dim,  # noqa: E402
                                                 reduce_scatter_along_first_dim, start_all_reduce)

OPERATIONS = ("all_reduce", "all_gather", "reduce_scatter")
WARMUP_CALLS = 5


def _all_reduce(buffer: torch.Tensor) -> torch.Tensor:
    start_all_reduce(buffer, dist.group.WORLD).wait()
    return buffer


def _all_gather(buffer: torch.Tensor) -> torch.Tensor:
    """The full buffer assembled from each rank's 1/n block."""
    block = buffer.shape[0] // dist.get_world_size()
    return all_gather_along_first_dim(buffer[:block], dist.group.WORLD)


def _reduce_scatter(buffer: torch.Tensor) -> torch.Tensor:
    return reduce_scatter_along_first_dim(buffer, dist.group.WORLD)


COLLECTIVES = {"all_reduce": _all_reduce, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter}


def bus_factor(operation: str, world_size: int) -> float:
    """Bus bandwidth / algorithm bandwidth (NCCL's convention)."""
    share = (world_size - 1) / world_size
    return 2 * share if operation == "all_reduce" else share


def _check(operation: str, buffer_elements: int, device: torch.device) -> None:
    """One call on rank-dependent values against the expected result; raises AssertionError."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    buffer = torch.full((buffer_elements,), float(rank + 1), dtype=torch.bfloat16, device=device)
    result = COLLECTIVES[operation](buffer)
    block = buffer_elements // world_size
    if operation == "all_gather":
        expected = torch.arange(1, world_size + 1, dtype=torch.bfloat16, device=device).repeat_interleave(block)
    else:
        total = world_size * (world_size + 1) // 2
        expected = torch.full((block if operation == "reduce_scatter" else buffer_elements,), float(total),
                              dtype=torch.bfloat16, device=device)
    assert torch.equal(result, expected), f"{operation} of {buffer_elements} elements gave a wrong result"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(operation: str, buffer_elements: int, device: torch.device, iterations: int) -> float:
    """Mean wall time of one collective, all ranks started together (a barrier) and the device drained."""
    buffer = torch.zeros(buffer_elements, dtype=torch.bfloat16, device=device)
    collective = COLLECTIVES[operation]
    for _ in range(WARMUP_CALLS):
        collective(buffer)
    _synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        collective(buffer)
    _synchronize(device)
    return (time.perf_counter() - start) / iterations


def table(sizes_mb: list[float], operations: list[str], iterations: int, device: torch.device) -> list[str]:
    """Markdown rows, one per operation and size (every rank runs them; rank 0 prints)."""
    world_size = dist.get_world_size()
    lines = ["| collective | MB | ranks | ms | algorithm GB/s | bus GB/s |", "|---|---|---|---|---|---|"]
    for operation in operations:
        for size_mb in sizes_mb:
            elements = int(size_mb * 2 ** 20) // 2 // world_size * world_size  # bf16, whole blocks
            _check(operation, elements, device)
            seconds = seconds_per_call(operation, elements, device, iterations)
            algorithm = elements * 2 / seconds / 1e9
            lines.append(f"| {operation} | {size_mb:g} | {world_size} | {seconds * 1e3:.3f} | {algorithm:.1f} | "
                         f"{algorithm * bus_factor(operation, world_size):.1f} |")
    return lines


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--operations", nargs="+", choices=OPERATIONS, default=list(OPERATIONS))
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args(argv)
    if args.iterations < 1:
        parser.error(f"--iterations must be at least 1, got {args.iterations}")
    if min(args.sizes_mb) <= 0:
        parser.error(f"--sizes-mb must be positive, got {args.sizes_mb}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        lines = table(args.sizes_mb, args.operations, args.iterations, device)
        if dist.get_rank() == 0:
            settings = {name: value for name, value in sorted(os.environ.items()) if name.startswith("NCCL_")}
            print(f"backend {dist.get_backend()}, NCCL settings: {settings or 'none'}")
            print("\n".join(lines))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
