"""Causal self-attention of the 1.3B GPT's training step on one GPU (torch's scaled_dot_product_attention,
bf16, micro-batch 16, 16 heads of 128, seq 2048) per backend and memory layout of q, k, v: forward and
forward + backward in ms (median of CUDA-event timings) and model TFLOP/s (causal: half the s^2
products; backward 2.5 times the forward), then the kernels of the trainer's layout's backward.

Layouts: "trainer", q, k, v as views of the query_key_value output [s, b, np, 3, hn] (per head its
query, key and value rows), the output's gradient sequence-first like the output; "bhsd", each
contiguous [b, np, s, hn]; "bshd", each contiguous [b, s, np, hn].

Grouped-query attention of the Llama-style 1.2B (32 query heads over 8 key/value groups of 64,
seq 4096, micro-batch 4; ``--grouped`` prints only this table): torch's fused GQA
(``enable_gqa=True``, which only the flash kernel takes) against the keys and values repeated to the
query heads (``repeat_interleave``, timed with it) under the default backend choice and under cuDNN.

    python3 tools/benchmarks/bench_attention.py [--batch 16] [--repeats 10] [--grouped]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools.benchmarks.cuda_timing import median_ms, refuse_non_positive  # noqa: E402

HEADS, HEAD_DIM, SEQ = 16, 128, 2048


def _inputs(layout, batch):
    """(the tensor q, k, v are views of, requiring grad; [q, k, v] as [b, np, s, hn] views)."""
    like = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if layout == "trainer":
        leaf = torch.randn(SEQ, batch, HEADS, 3, HEAD_DIM, **like)
        return leaf, [leaf[:, :, :, i].permute(1, 2, 0, 3) for i in range(3)]
    if layout == "bhsd":
        leaf = torch.randn(3, batch, HEADS, SEQ, HEAD_DIM, **like)
        return leaf, list(leaf.unbind(0))
    leaf = torch.randn(3, batch, SEQ, HEADS, HEAD_DIM, **like)
    return leaf, [t.transpose(1, 2) for t in leaf.unbind(0)]


def _grad_output(layout, batch):
    if layout == "trainer":  # dense's input gradient [s, b, np * hn] seen as [b, np, s, hn]
        return torch.randn(SEQ, batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3)
    if layout == "bshd":
        return torch.randn(batch, SEQ, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    return torch.randn(batch, HEADS, SEQ, HEAD_DIM, device="cuda", dtype=torch.bfloat16)


def _case(backend, layout, batch, repeats):
    leaf, (query, key, value) = _inputs(layout, batch)
    grad_output = _grad_output(layout, batch)
    with sdpa_kernel(backend):
        def forward():
            with torch.no_grad():
                F.scaled_dot_product_attention(query, key, value, is_causal=True)

        def forward_backward():
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True)
            torch.autograd.grad(out, leaf, grad_output)

        return median_ms(forward, repeats), median_ms(forward_backward, repeats), forward_backward


def grouped_query_table(repeats, batch=4, heads=32, groups=8, head_dim=64, seq=4096):
    """The module docstring's grouped-query table: forward + backward ms of each way."""
    like = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
    query = torch.randn(batch, heads, seq, head_dim, **like)
    key, value = (torch.randn(batch, groups, seq, head_dim, **like) for _ in range(2))
    grad_output = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)

    def fused(backend):
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
            torch.autograd.grad(out, (query, key, value), grad_output)

    def repeated(backends):
        with sdpa_kernel(backends):
            keys, values = (t.repeat_interleave(heads // groups, dim=1) for t in (key, value))
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True)
            torch.autograd.grad(out, (query, key, value), grad_output)

    forward_backward_flop = 3.5 * 4 * batch * heads * seq * seq * head_dim / 2
    print(f"\ngrouped-query attention: b {batch}, {heads} heads over {groups} groups of {head_dim}, seq {seq}")
    print("| way | forward + backward ms | TFLOP/s |\n|---|---|---|")
    default_order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                     SDPBackend.MATH]
    for name, call in (("enable_gqa, flash", lambda: fused(SDPBackend.FLASH_ATTENTION)),
                       ("keys repeated, cuDNN", lambda: repeated(SDPBackend.CUDNN_ATTENTION)),
                       ("keys repeated, flash", lambda: repeated(SDPBackend.FLASH_ATTENTION)),
                       ("keys repeated, any backend", lambda: repeated(default_order))):
        try:
            ms = median_ms(call, repeats)
        except RuntimeError as error:
            print(f"| {name} | {str(error).splitlines()[0][:60]} | |")
            continue
        print(f"| {name} | {ms:.2f} | {forward_backward_flop / ms / 1e9:.0f} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--grouped", action="store_true", help="only the grouped-query table")
    args = parser.parse_args(argv)
    refuse_non_positive(parser, args, "batch", "repeats")
    if args.grouped:
        grouped_query_table(args.repeats)
        return
    forward_flop = 4 * args.batch * HEADS * SEQ * SEQ * HEAD_DIM / 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print("| backend | layout | forward ms | TFLOP/s | forward + backward ms | backward TFLOP/s |\n|---|---|---|---|---|---|")
    trainer_call = None
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        for layout in ("trainer", "bhsd", "bshd"):
            try:
                forward, both, call = _case(backend, layout, args.batch, args.repeats)
            except RuntimeError as error:
                print(f"| {backend.name} | {layout} | {str(error).splitlines()[0][:60]} | | | |")
                continue
            backward = both - forward
            print(f"| {backend.name} | {layout} | {forward:.2f} | {forward_flop / forward / 1e9:.0f} | {both:.2f} "
                  f"| {2.5 * forward_flop / backward / 1e9:.0f} |")
            if backend == SDPBackend.CUDNN_ATTENTION and layout == "trainer":
                trainer_call = call
    leaf, (query, key, value) = _inputs("trainer", args.batch)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        grads = torch.autograd.grad(out, (query, key, value), _grad_output("trainer", args.batch))
    print(f"\ntrainer layout, cuDNN: output [b, np, s, hn] strides {out.stride()}, dq {grads[0].stride()}, "
          f"dk {grads[1].stride()}, dv {grads[2].stride()}")
    if trainer_call is not None:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            trainer_call()
            torch.cuda.synchronize()
        print("\nkernels of the trainer layout's forward + backward (cuDNN):")
        print(profile.key_averages().table(sort_by="cuda_time_total", row_limit=8))
    grouped_query_table(args.repeats)


if __name__ == "__main__":
    main()
