"""Tensor parallelism's collectives fused with their GEMMs (async TP) against the collective, then the GEMM.

    torchrun --nproc_per_node 2 tools/benchmarks/bench_async_tp.py [--iterations 20] [--trace-dir DIR]

Under sequence parallelism every column-parallel product starts from an all-gather of the
sequence blocks and every row-parallel product ends in a reduce-scatter; backward swaps the two.
For each product of a transformer layer of the 1.3B GPT (hidden 2048, micro-batch 8, seq 2048) and
of a width-4096 GPT (micro-batch 4), at TP = world size and in bf16, rank 0 prints the mean time of
``--iterations`` calls after 5 warm-up calls of:

    gemm        the product alone, on the gathered (or full) operand
    serial      NCCL's collective, then the GEMM (or the GEMM, then the collective)
    fused       megatron.core.tensor_parallel.async_tp.all_gather_matmul / matmul_reduce_scatter

and checks once that fused and serial agree (relative error of bf16 GEMMs summed over ranks).
"fused host" is the median time the host takes to issue one fused call (on an idle GPU, so that
no launch waits for queue space): where it exceeds the fused GPU time, a run of such calls is
bound by the host, not the GPU.

The column-parallel layers' backward ("qkv dX + dW", "fc1 dX + dW") reduce-scatters dX = dY W and
computes the weight gradient dW = dY^T X: there gemm is both products, serial the plain
sequence-parallel backward (dX, NCCL's reduce-scatter launched asynchronously, dW while it runs,
wait), fused the --tp-comm-overlap backward (start_matmul_reduce_scatter, dW while the partial sums
travel, wait). The row-parallel layers' backward ("dense dX + dW", "fc2 dX + dW") all-gathers dY for
dX = dY W and dW = dY^T X, dW added into an fp32 accumulator as the trainer's weights do: serial
NCCL's all-gather, then both GEMMs; fused all_gather_matmul_each_block, dW taken block by block
as the blocks arrive.

``--trace-dir`` also writes rank 0's torch.profiler trace of three fused calls per product there
(``<model>_<product>.json``, spaces and signs as "_"; for Perfetto: where the copies and GEMMs of
a call overlap).
"""
import argparse
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.tensor_parallel.async_tp import (  # noqa: E402
    all_gather_matmul, all_gather_matmul_each_block, matmul_reduce_scatter, start_matmul_reduce_scatter)
from megatron.core.tensor_parallel.utils import (  # noqa: E402
    all_gather_along_first_dim, reduce_scatter_along_first_dim, start_reduce_scatter_along_first_dim)

WARMUP_CALLS = 5
# (model, product, kind, rows of the full operand, its columns, the product's columns at TP=k)
# rows = s * b tokens; columns of column-parallel outputs and row-parallel inputs are divided by k.
PRODUCTS = (
    ("1.3B", "qkv", "gather", 16384, 2048, lambda k: 3 * 2048 // k),
    ("1.3B", "fc1", "gather", 16384, 2048, lambda k: 4 * 2048 // k),
    ("1.3B", "dense", "scatter", 16384, lambda k: 2048 // k, 2048),
    ("1.3B", "fc2", "scatter", 16384, lambda k: 4 * 2048 // k, 2048),
    ("1.3B", "qkv dX + dW", "scatter+dW", 16384, lambda k: 3 * 2048 // k, 2048),
    ("1.3B", "fc1 dX + dW", "scatter+dW", 16384, lambda k: 4 * 2048 // k, 2048),
    ("1.3B", "dense dX + dW", "gather+dW", 16384, 2048, lambda k: 2048 // k),
    ("1.3B", "fc2 dX + dW", "gather+dW", 16384, 2048, lambda k: 4 * 2048 // k),
    ("width 4096", "qkv", "gather", 8192, 4096, lambda k: 3 * 4096 // k),
    ("width 4096", "fc1", "gather", 8192, 4096, lambda k: 4 * 4096 // k),
    ("width 4096", "dense", "scatter", 8192, lambda k: 4096 // k, 4096),
    ("width 4096", "fc2", "scatter", 8192, lambda k: 4 * 4096 // k, 4096),
)


def _resolve(size, world_size: int) -> int:
    return size(world_size) if callable(size) else size


def _time_ms(call, iterations: int) -> float:
    for _ in range(WARMUP_CALLS):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iterations):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iterations


def _operands(kind: str, rows: int, inner: int, columns: int, world_size: int, device):
    """(this rank's operand, the weight's transposed view [inner, columns]) as the layers pass them."""
    torch.manual_seed(1234 + dist.get_rank())
    local_rows = rows // world_size if kind.startswith("gather") else rows  # a scatter's operand is whole
    a = torch.randn(local_rows, inner, dtype=torch.bfloat16, device=device)
    weight = torch.randn(columns, inner, dtype=torch.bfloat16, device=device) / inner ** 0.5  # [out, in]
    return a, weight.t()


def _calls(kind: str, a: torch.Tensor, matrix: torch.Tensor, group):
    """(gemm alone, serial, fused) callables returning the product."""
    if kind == "gather":
        gathered = all_gather_along_first_dim(a, group)
        return (lambda: gathered.matmul(matrix),
                lambda: all_gather_along_first_dim(a, group).matmul(matrix),
                lambda: all_gather_matmul(a, matrix, group)[1])
    if kind == "scatter":
        return (lambda: a.matmul(matrix),
                lambda: reduce_scatter_along_first_dim(a.matmul(matrix), group),
                lambda: matmul_reduce_scatter(a, matrix, group))
    if kind == "gather+dW":
        return _row_parallel_backward_calls(a, matrix, group)
    x = torch.randn(a.shape[0], matrix.shape[1], dtype=a.dtype, device=a.device)  # the layer's gathered input

    def weight_grad():
        return a.t().matmul(x)  # dW = dY^T X

    def serial():
        grad_input, reduction = start_reduce_scatter_along_first_dim(a.matmul(matrix), group)
        weight_grad()
        reduction.wait()
        return grad_input

    def fused():
        grad_input, reduction = start_matmul_reduce_scatter(a, matrix, group)
        weight_grad()
        reduction.wait()
        return grad_input

    return (lambda: (a.matmul(matrix), weight_grad())[0], serial, fused)


def _row_parallel_backward_calls(a: torch.Tensor, matrix: torch.Tensor, group):
    """(gemm alone, serial, fused) of the row-parallel backward: a = this rank's dY block, matrix = W
    [out, in / k]; each adds dW = dY^T X into one fp32 accumulator and returns dX."""
    gathered = all_gather_along_first_dim(a, group)  # [s, out]
    x = torch.randn(gathered.shape[0], matrix.shape[1], dtype=a.dtype, device=a.device)  # [s, in / k]
    x_blocks = x.split(a.shape[0])
    main_grad = torch.zeros(matrix.shape, dtype=torch.float32, device=a.device)

    def add_weight_grad(grad_output, x_rows):
        torch.addmm(main_grad, grad_output.t(), x_rows, out_dtype=torch.float32, out=main_grad)

    def both_gemms(total):
        add_weight_grad(total, x)
        return total.matmul(matrix)

    def fused():
        return all_gather_matmul_each_block(a, matrix, group,
                                            lambda rank, block: add_weight_grad(block, x_blocks[rank]))

    return (lambda: both_gemms(gathered), lambda: both_gemms(all_gather_along_first_dim(a, group)), fused)


def _host_ms(call, iterations: int) -> float:
    """Median host time to issue ``call`` once, the GPU idle before each."""
    times = []
    for _ in range(iterations):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return 1e3 * statistics.median(times)


def _write_trace(call, path: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(3):
            call()
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        profiler.export_chrome_trace(path)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--trace-dir", help="write a trace of three fused calls per product here (rank 0)")
    args = parser.parse_args(argv)
    if args.iterations < 1:
        parser.error(f"--iterations must be at least 1, got {args.iterations}")
    if not torch.cuda.is_available():
        parser.error("it times CUDA kernels on the GPUs of one machine: run it under torchrun on a GPU machine")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world_size, group, device = dist.get_world_size(), dist.group.WORLD, torch.device("cuda", local_rank)
    lines = [f"TP={world_size}, bf16, {torch.cuda.get_device_name()}, ms per call",
             "| model | product | collective | operand (full) | gemm | serial | fused | fused / serial "
             "| fused host | relative error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for model, name, kind, rows, inner, columns in PRODUCTS:
        inner, columns = _resolve(inner, world_size), _resolve(columns, world_size)
        a, matrix = _operands(kind, rows, inner, columns, world_size, device)
        gemm, serial, fused = _calls(kind, a, matrix, group)
        expected, got = serial().float(), fused().float()
        error = ((got - expected).norm() / expected.norm()).item()
        times = [_time_ms(call, args.iterations) for call in (gemm, serial, fused)]
        host = _host_ms(fused, args.iterations)
        if args.trace_dir:
            os.makedirs(args.trace_dir, exist_ok=True)
            stem = re.sub(r"[^A-Za-z0-9.]+", "_", f"{model}_{name}")
            _write_trace(fused, os.path.join(args.trace_dir, stem + ".json"))
        lines.append(f"| {model} | {name} | {'all-gather' if kind.startswith('gather') else 'reduce-scatter'} "
                     f"| [{rows}, {inner}] x [{inner}, {columns}] | {times[0]:.3f} | {times[1]:.3f} "
                     f"| {times[2]:.3f} | {times[2] / times[1]:.2f} | {host:.3f} | {error:.1e} |")
    if dist.get_rank() == 0:
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
