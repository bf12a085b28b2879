"""The one-row decode layer's kernels back to back on one GPU: how close a batch-1 step gets to the bandwidth.

24 layers of the 1.3B GPT (hidden 2048, 16 heads, ffn 8192, bf16, random weights), one token over
a 384-position cache with 256 filled, replayed from a CUDA graph, each variant after one untimed
replay:

    one-row layer       per layer: layer_norm_linear (QKV), decode_attention (writes the cache),
                        linear + residual (dense), layer_norm_linear + GeLU (h -> 4h),
                        linear + residual (4h -> h): what decode_layers.one_row_step runs at batch 1
    GEMVs alone         the four products per layer, no norm, attention or epilogue: the floor

each with the kernels launched as programmatic dependents (PDL, Hopper and later) and without.
Reported: microseconds per 24 layers and the weights' bytes over that time as a fraction of the
copy bandwidth measured here.

    python tools/benchmarks/bench_decode_layers.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core import fused_kernels  # noqa: E402
from tools.benchmarks.bench_text_generation import copy_bandwidth, graph_replay_seconds  # noqa: E402

LAYERS, HIDDEN, HEADS, FFN, CAPACITY, FILLED = 24, 2048, 16, 8192, 384, 256
HEAD_DIM = HIDDEN // HEADS


def random_layers(dtype=torch.bfloat16):
    def matrix(rows, columns):
        return torch.randn(rows, columns, device="cuda", dtype=dtype) / columns ** 0.5

    def vector(size, scale=0.02):
        return torch.randn(size, device="cuda", dtype=dtype) * scale

    return [dict(norm=(1 + vector(HIDDEN), vector(HIDDEN)), qkv=(matrix(3 * HIDDEN, HIDDEN), vector(3 * HIDDEN)),
                 dense=(matrix(HIDDEN, HIDDEN), vector(HIDDEN)), fc1=(matrix(FFN, HIDDEN), vector(FFN)),
                 fc2=(matrix(HIDDEN, FFN), vector(HIDDEN)),
                 cache=[torch.randn(1, HEADS, CAPACITY, HEAD_DIM, device="cuda", dtype=dtype) for _ in range(2)])
            for _ in range(LAYERS)]


def one_row_layers(layers, x, position):
    for layer in layers:
        norm = (*layer["norm"], 1e-5)
        mixed = fused_kernels.layer_norm_linear(x, *norm, *layer["qkv"]).view(1, 1, HEADS, 3 * HEAD_DIM)
        query, key, value = (t.permute(1, 2, 0, 3) for t in mixed.split(HEAD_DIM, dim=-1))
        context = fused_kernels.decode_attention(query, *layer["cache"], position, None, HEAD_DIM ** -0.5, key, value)
        x = fused_kernels.linear(context.view(1, 1, HIDDEN), *layer["dense"], x)
        intermediate = fused_kernels.layer_norm_linear(x, *norm, *layer["fc1"], "gelu_tanh")
        x = fused_kernels.linear(intermediate, *layer["fc2"], x)
    return x


def gemvs_alone(layers, x, position):
    for layer in layers:
        fused_kernels.linear(x, layer["qkv"][0])
        fused_kernels.linear(x, layer["dense"][0])
        intermediate = fused_kernels.linear(x, layer["fc1"][0])
        x = fused_kernels.linear(intermediate, layer["fc2"][0])
    return x


def main():
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_layers.py needs a CUDA GPU")
    from megatron.core.fused_kernels import triton_decode  # imports triton, which a GPU machine has
    bandwidth = copy_bandwidth()
    layers = random_layers()
    weight_bytes = sum(layer[name][0].numel() * 2 for layer in layers for name in ("qkv", "dense", "fc1", "fc2"))
    x = torch.randn(1, 1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    position = torch.tensor([FILLED - 1], device="cuda")
    pdl_supported = triton_decode.programmatic_launch(x)
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s, weights "
          f"{weight_bytes / 1e9:.2f} GB in {LAYERS} layers; PDL {'available' if pdl_supported else 'not available'}")
    with torch.no_grad():
        for name, chain in (("one-row layer", one_row_layers), ("GEMVs alone", gemvs_alone)):
            for pdl in (True, False) if pdl_supported else (False,):
                triton_decode._HAS_GRID_DEPENDENCY_CONTROL = pdl
                seconds = graph_replay_seconds(lambda: chain(layers, x, position), repeats=4)
                print(f"{name:14s} | PDL {'on ' if pdl else 'off'} | {seconds * 1e6:8.1f} us per {LAYERS} layers | "
                      f"{weight_bytes / seconds / bandwidth:6.1%} of copy bandwidth")
        triton_decode._HAS_GRID_DEPENDENCY_CONTROL = pdl_supported


if __name__ == "__main__":
    main()
