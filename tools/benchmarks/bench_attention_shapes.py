"""cuDNN's causal attention alone at the shapes of the Ulysses benchmarks (one GPU).

    python tools/benchmarks/bench_attention_shapes.py [HEADS:SEQUENCE ...]

Default shapes: 8 heads at 32768 (a rank of the 1.3B GPT at S = 2), 16 at 57344 (one GPU at the longest
sequence that fits an H200), 16 at 30720 (an 80 GB H100). Head size 128, micro-batch 1, bf16, the
[s, b, heads, hn] layout the model hands to SDPA; forward alone and forward + backward, mean of 8 after 3
warm-ups. TFLOP/s count the causal half: forward 2 s^2 hn heads, backward 2.5 times that. Set beside a
trainer profile's attention time per layer and micro-batch, it tells how much slower the kernels run inside
training than alone.
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

DEFAULT_SHAPES = ("8:32768", "16:57344", "16:30720")
HEAD_DIM = 128


def timed_ms(function, repeats: int = 8) -> float:
    for _ in range(3):
        function()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def measure(heads: int, sequence: int) -> tuple[float, float]:
    """(forward ms, backward ms) of causal cuDNN attention over ``heads`` heads of ``sequence`` positions."""
    def operand():
        shape = (sequence, 1, heads, HEAD_DIM)
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3).requires_grad_()

    query, key, value = operand(), operand(), operand()
    grad = torch.randn(1, heads, sequence, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        def forward():
            with torch.no_grad():
                F.scaled_dot_product_attention(query, key, value, is_causal=True)

        def forward_and_backward():
            F.scaled_dot_product_attention(query, key, value, is_causal=True).backward(grad)

        forward_ms = timed_ms(forward)
        return forward_ms, timed_ms(forward_and_backward) - forward_ms


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shapes", nargs="*", default=list(DEFAULT_SHAPES), metavar="HEADS:SEQUENCE")
    args = parser.parse_args(argv)
    try:
        shapes = [tuple(int(part) for part in shape.split(":")) for shape in args.shapes]
    except ValueError:
        parser.error(f"shapes are HEADS:SEQUENCE, e.g. 8:32768; got {args.shapes}")
    if any(len(shape) != 2 or min(shape) < 1 for shape in shapes):
        parser.error(f"shapes are two positive integers HEADS:SEQUENCE; got {args.shapes}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    print("| heads | sequence | forward (ms) | forward TFLOP/s | backward (ms) | backward TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for heads, sequence in shapes:
        forward_ms, backward_ms = measure(heads, sequence)
        flops = 2 * sequence ** 2 * HEAD_DIM * heads
        print(f"| {heads} | {sequence} | {forward_ms:.2f} | {flops / forward_ms / 1e9:.0f} | {backward_ms:.2f} | "
              f"{2.5 * flops / backward_ms / 1e9:.0f} |", flush=True)


if __name__ == "__main__":
    main()
