"""The linear layers' GEMMs of a 1.3B GPT training step on one GPU (hidden 2048, ffn 8192, micro-batch 16
at seq 2048: 32768 tokens, bf16) in model TFLOP/s, per cuBLAS library torch may call (cuBLAS, the
default for plain products, and cuBLASLt): the forward Y = X W^T (+ b for the query_key_value
projection, as the trainer adds it), dX = dY W, and dW added into an fp32 accumulator
(addmm with fp32 output and beta = 1, the trainer's gradient-accumulation fusion).

    python3 tools/benchmarks/bench_gemms.py [--tokens 32768] [--repeats 20]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools.benchmarks.cuda_timing import median_ms, refuse_non_positive  # noqa: E402

HIDDEN, FFN = 2048, 8192
LAYERS = {"qkv": (HIDDEN, 3 * HIDDEN), "dense": (HIDDEN, HIDDEN), "fc1": (HIDDEN, FFN), "fc2": (FFN, HIDDEN)}


def _products(tokens, fan_in, fan_out, with_bias):
    """name -> call of the three GEMMs of one layer."""
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x, dy = torch.randn(tokens, fan_in, **bf16), torch.randn(tokens, fan_out, **bf16)
    weight = torch.randn(fan_out, fan_in, **bf16) / fan_in ** 0.5
    bias = torch.randn(fan_out, **bf16) if with_bias else None
    main_grad = torch.zeros(fan_out, fan_in, device="cuda")
    return {"forward": lambda: F.linear(x, weight, bias),
            "dX": lambda: dy.matmul(weight),
            "dW into fp32": lambda: torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32, out=main_grad)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    refuse_non_positive(parser, args, "tokens", "repeats")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.tokens} tokens")
    libraries = ("cublas", "cublaslt")
    print("| layer | GEMM | " + " | ".join(f"{lib} ms | TFLOP/s" for lib in libraries) + " |")
    print("|---|---|" + "---|---|" * len(libraries))
    totals = dict.fromkeys(libraries, 0.0)
    for layer, (fan_in, fan_out) in LAYERS.items():
        flop = 2 * args.tokens * fan_in * fan_out
        for name, call in _products(args.tokens, fan_in, fan_out, with_bias=layer == "qkv").items():
            cells = []
            for library in libraries:
                torch.backends.cuda.preferred_blas_library(library)
                ms = median_ms(call, args.repeats, warmup=3)
                totals[library] += ms
                cells.append(f"{ms:.3f} | {flop / ms / 1e9:.0f}")
            print(f"| {layer} | {name} | " + " | ".join(cells) + " |")
    torch.backends.cuda.preferred_blas_library("cublas")
    print("| all | | " + " | ".join(f"{totals[lib]:.3f} | " for lib in libraries) + " |")


if __name__ == "__main__":
    main()
