"""The optimizer step of the bf16 trainer on one GPU: torch's fused AdamW then the cast of the fp32
master weights into the bf16 weights (DeepSpeed's BF16_Optimizer), against ``fused_kernels.adamw_step``
writing the bf16 weights in its own pass; each with the clip's grad_scale, over one flat fp32
tensor of a 1.3B GPT's parameters. Prints ms per step (median of CUDA-event timings) and the
bandwidth over the bytes each must move, then the Triton kernel's launch configurations.

    python3 tools/benchmarks/bench_adamw_step.py [--elements 1316000000] [--repeats 10]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from megatron.core import fused_kernels  # noqa: E402
from tools.benchmarks.cuda_timing import median_ms, refuse_non_positive  # noqa: E402

SETTINGS = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _torch_step(n, grad_scale):
    """torch's fused AdamW on a flat fp32 tensor, then the bf16 copy (what DeepSpeed runs)."""
    master = torch.nn.Parameter(torch.randn(n, device="cuda"))
    master.grad = torch.randn(n, device="cuda")
    weights = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW([master], lr=SETTINGS["lr"], betas=(SETTINGS["beta1"], SETTINGS["beta2"]),
                                  eps=SETTINGS["eps"], weight_decay=SETTINGS["weight_decay"], fused=True)
    optimizer.grad_scale = grad_scale

    def step():
        optimizer.step()
        weights.copy_(master.detach())

    return step, (master, weights, optimizer)


def _our_step(n, grad_scale, **launch):
    tensors = [torch.randn(n, device="cuda") for _ in range(2)] + [torch.zeros(n, device="cuda") for _ in range(2)]
    weights = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    count = torch.zeros((), device="cuda")

    if launch:  # a launch configuration of the kernel itself (triton_adamw imports triton)
        from megatron.core.fused_kernels import triton_adamw

    def step():
        count.add_(1)
        if launch:
            triton_adamw.adamw_step(*tensors, count, grad_scale=grad_scale, param_copy=weights, **SETTINGS, **launch)
        else:
            fused_kernels.adamw_step(*tensors, count, grad_scale=grad_scale, param_copy=weights, **SETTINGS)

    return step, (tensors, weights)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=1_316_000_000, help="parameters (default: the 1.3B GPT)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    refuse_non_positive(parser, args, "elements", "repeats")
    n, grad_scale = args.elements, torch.tensor(1.5, device="cuda")
    print(f"{torch.cuda.get_device_name()}, {n} fp32 parameters, bf16 weights, with a grad_scale")
    print("| step | ms | bytes per parameter | GB/s |\n|---|---|---|---|")
    for name, make, nbytes in (("torch fused AdamW + bf16 copy", _torch_step, 32 + 6),
                               ("fused_kernels.adamw_step", _our_step, 30)):
        step, keep = make(n, grad_scale)
        ms = median_ms(step, args.repeats)
        print(f"| {name} | {ms:.2f} | {nbytes} | {nbytes * n / ms / 1e6:.0f} |")
        del step, keep
        torch.cuda.empty_cache()
    print("\n| block | warps | ms |\n|---|---|---|")
    for block in (1024, 2048, 4096, 8192):
        for num_warps in (4, 8, 16):
            step, keep = _our_step(n, grad_scale, block=block, num_warps=num_warps)
            print(f"| {block} | {num_warps} | {median_ms(step, args.repeats):.2f} |")
            del step, keep
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
