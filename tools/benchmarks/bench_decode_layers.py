"""The one-row decode layer's kernels back to back on one GPU: how close a batch-1 step gets to the bandwidth.

24 layers of the 1.3B GPT (hidden 2048, 16 heads, ffn 8192, bf16, random weights), one token over
a 384-position cache with 256 filled, replayed from a CUDA graph, each variant after one untimed
replay:

    one-row layer       per layer: layer_norm_linear (QKV), decode_attention (writes the cache),
                        linear + residual (dense), layer_norm_linear + GeLU (h -> 4h),
                        linear + residual (4h -> h): what decode_layers.one_row_step runs at batch 1
    GEMVs alone         the four products per layer, no norm, attention or epilogue: the floor

and 16 layers of a Llama-style 1.2B model (hidden 2048, 32 heads of 64 over 8 key/value groups,
SwiGLU ffn 8192, RMSNorm, no biases) over the same cache positions:

    Llama one-row layer per layer: layer_norm_linear with norm="rms" (QKV, [g, q + 2, hn] rows),
                        decode_attention reading those rows, turning the query and key by the
                        rotary embedding, writing the grouped cache; linear + residual,
                        layer_norm_linear with norm="rms" and "swiglu" (h -> 2 ffn -> ffn),
                        linear + residual (ffn -> h)
    Llama GEMVs alone   the same four products, alone

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
LLAMA_LAYERS, LLAMA_HEADS, LLAMA_GROUPS = 16, 32, 8
LLAMA_HEAD_DIM, LLAMA_QUERIES = HIDDEN // LLAMA_HEADS, LLAMA_HEADS // LLAMA_GROUPS


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


def random_llama_layers(dtype=torch.bfloat16):
    """Weights without biases (None), RMSNorm weights, SwiGLU's [W_a; W_g] and a cache of 8 groups."""
    def matrix(rows, columns):
        return torch.randn(rows, columns, device="cuda", dtype=dtype) / columns ** 0.5

    qkv_rows = LLAMA_GROUPS * (LLAMA_QUERIES + 2) * LLAMA_HEAD_DIM
    return [dict(norms=[1 + 0.02 * torch.randn(HIDDEN, device="cuda", dtype=dtype) for _ in range(2)],
                 qkv=(matrix(qkv_rows, HIDDEN), None), dense=(matrix(HIDDEN, HIDDEN), None),
                 fc1=(matrix(2 * FFN, HIDDEN), None), fc2=(matrix(HIDDEN, FFN), None),
                 cache=[torch.randn(1, LLAMA_GROUPS, CAPACITY, LLAMA_HEAD_DIM, device="cuda", dtype=dtype)
                        for _ in range(2)])
            for _ in range(LLAMA_LAYERS)]


def llama_one_row_layers(layers, x, position):
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, LLAMA_HEAD_DIM, 2, device="cuda") / LLAMA_HEAD_DIM)
    for layer in layers:
        mixed = fused_kernels.layer_norm_linear(x, layer["norms"][0], None, 1e-5, *layer["qkv"], norm="rms")
        rows = mixed.view(1, 1, LLAMA_GROUPS, LLAMA_QUERIES + 2, LLAMA_HEAD_DIM).permute(1, 2, 3, 0, 4)
        context = fused_kernels.decode_attention(rows[:, :, :LLAMA_QUERIES], *layer["cache"], position, None,
                                                 LLAMA_HEAD_DIM ** -0.5, rows[:, :, LLAMA_QUERIES],
                                                 rows[:, :, LLAMA_QUERIES + 1], (inv_freq, position))
        x = fused_kernels.linear(context.view(1, 1, HIDDEN), *layer["dense"], x)
        intermediate = fused_kernels.layer_norm_linear(x, layer["norms"][1], None, 1e-5, *layer["fc1"], "swiglu",
                                                       norm="rms")
        x = fused_kernels.linear(intermediate, *layer["fc2"], x)
    return x


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
        intermediate = fused_kernels.linear(x, layer["fc1"][0])  # SwiGLU's: [a | g], the down projection reads n
        x = fused_kernels.linear(intermediate[..., :layer["fc2"][0].shape[1]], layer["fc2"][0])
    return x


def main():
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_layers.py needs a CUDA GPU")
    from megatron.core.fused_kernels import triton_decode  # imports triton, which a GPU machine has
    bandwidth = copy_bandwidth()
    x = torch.randn(1, 1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    position = torch.tensor([FILLED - 1], device="cuda")
    pdl_supported = triton_decode.programmatic_launch(x)
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
          f"PDL {'available' if pdl_supported else 'not available'}")
    models = (("GPT 1.3B", random_layers, (("one-row layer", one_row_layers), ("GEMVs alone", gemvs_alone))),
              ("Llama 1.2B", random_llama_layers, (("one-row layer", llama_one_row_layers),
                                                   ("GEMVs alone", gemvs_alone))))
    with torch.no_grad():
        for model, make_layers, chains in models:
            layers = make_layers()
            weight_bytes = sum(layer[name][0].numel() * 2 for layer in layers for name in ("qkv", "dense", "fc1", "fc2"))
            print(f"{model}: weights {weight_bytes / 1e9:.2f} GB in {len(layers)} layers")
            for name, chain in chains:
                for pdl in (True, False) if pdl_supported else (False,):
                    triton_decode._HAS_GRID_DEPENDENCY_CONTROL = pdl
                    seconds = graph_replay_seconds(lambda: chain(layers, x, position), repeats=4)
                    print(f"{model:10s} {name:14s} | PDL {'on ' if pdl else 'off'} | {seconds * 1e6:8.1f} us per "
                          f"{len(layers)} layers | {weight_bytes / seconds / bandwidth:6.1%} of copy bandwidth")
            del layers
        triton_decode._HAS_GRID_DEPENDENCY_CONTROL = pdl_supported


if __name__ == "__main__":
    main()
