"""The FP8 GEMMs of the linear layers against bf16 cuBLAS, per shape, on one GPU: the 1.3B GPT (hidden
2048, ffn 8192) and the 6.7B GPT at TP = 2 (hidden 4096, ffn 16384, each rank's half), at 32768
tokens (micro-batch 16 x seq 2048) by default.

For each layer and each of its three GEMMs (Y = X W^T, dX = dY W, dW = dY^T X):

    bf16            cuBLAS on bf16 operands (dW into an fp32 accumulator, the trainer's fusion)
    _scaled_mm      torch._scaled_mm on operands already in FP8 (e4m3; e5m2 dY with --fp8-format hybrid)
    fp8_linear      the layer's FP8 forward and backward (``Fp8Gemms``): amaxes, the quantization of
                    each tensor and its transpose (one fused pass each on a GPU) and the GEMMs, from
                    bf16 tensors, per tensor (--recipe tensorwise or delayed) or per row (rowwise)

in ms and TFLOP/s, then the quantization overhead (fp8_linear - _scaled_mm) per layer and per
micro-batch of the model.

    python3 tools/benchmarks/bench_fp8_gemms.py [--tokens 32768] [--repeats 20] [--recipe tensorwise]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from megatron.core.tensor_parallel import fp8  # noqa: E402
from megatron.core.tensor_parallel.fp8_linear import Fp8Gemms  # noqa: E402
from tools.benchmarks.cuda_timing import median_ms, refuse_non_positive  # noqa: E402

# model -> (layers, {layer: (fan_in, fan_out) on one rank})
MODELS = {"1.3B": (24, {"qkv": (2048, 3 * 2048), "dense": (2048, 2048), "fc1": (2048, 8192), "fc2": (8192, 2048)}),
          "6.7B TP=2": (32, {"qkv": (4096, 3 * 4096 // 2), "dense": (4096 // 2, 4096), "fc1": (4096, 16384 // 2),
                             "fc2": (16384 // 2, 4096)})}


def _bf16_calls(x, weight, grad_y):
    main_grad = torch.zeros(weight.shape, device="cuda")
    return {"Y": lambda: x.matmul(weight.t()), "dX": lambda: grad_y.matmul(weight),
            "dW": lambda: torch.addmm(main_grad, grad_y.t(), x, out_dtype=torch.float32, out=main_grad)}


def _scaled_mm_calls(x, weight, grad_y, config):
    """The three GEMMs on operands quantized beforehand (what the GEMMs alone cost)."""
    def operand(tensor, role):
        return fp8.quantize_operand(tensor, config.dtype(role), 0, rowwise=config.recipe == "rowwise")

    q_x, q_w, q_g = operand(x, "input"), operand(weight, "weight"), operand(grad_y, "grad_output")
    q_w_t, q_g_t, q_x_t = operand(weight.t(), "weight"), operand(grad_y.t(), "grad_output"), operand(x.t(), "input")
    return {"Y": lambda: fp8.scaled_mm(q_x, q_w, torch.bfloat16, False),
            "dX": lambda: fp8.scaled_mm(q_g, q_w_t, torch.bfloat16, False),
            "dW": lambda: fp8.scaled_mm(q_g_t, q_x_t, torch.float32, False)}


def _fp8_linear_passes(x, weight, grad_y, config):
    """The layer's forward (Y) and backward (dX and dW from one quantization of dY) from bf16
    tensors, quantization and transposes included."""
    gemms = Fp8Gemms(config, None, None, device="cuda")
    _, saved = gemms.output(x, weight)

    def backward():
        grad = gemms.grad_operands(grad_y)
        gemms.grad_input(grad, saved, torch.bfloat16)
        gemms.grad_weight(grad, saved, torch.float32)

    return {"forward": lambda: gemms.output(x, weight), "backward": backward}


def _print_model(model, tokens, repeats, config):
    layers, shapes = MODELS[model]
    print(f"\n{model}: {layers} layers, {tokens} tokens, {config.format}, {config.recipe}")
    print("| layer | GEMM | bf16 ms | TFLOP/s | _scaled_mm ms | TFLOP/s | x bf16 |")
    print("|---|---|---|---|---|---|---|")
    passes = {"bf16": {"forward": 0.0, "backward": 0.0}, "scaled_mm": {"forward": 0.0, "backward": 0.0},
              "fp8_linear": {"forward": 0.0, "backward": 0.0}}
    for layer, (fan_in, fan_out) in shapes.items():
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        x, grad_y = torch.randn(tokens, fan_in, **bf16), torch.randn(tokens, fan_out, **bf16) * 1e-3
        weight = torch.randn(fan_out, fan_in, **bf16) / fan_in ** 0.5
        kinds = {"bf16": _bf16_calls(x, weight, grad_y), "scaled_mm": _scaled_mm_calls(x, weight, grad_y, config)}
        flop = 2 * tokens * fan_in * fan_out
        for gemm in ("Y", "dX", "dW"):
            ms = {kind: median_ms(calls[gemm], repeats, warmup=3) for kind, calls in kinds.items()}
            for kind in kinds:
                passes[kind]["forward" if gemm == "Y" else "backward"] += ms[kind]
            print(f"| {layer} | {gemm} | {ms['bf16']:.3f} | {flop / ms['bf16'] / 1e9:.0f} | {ms['scaled_mm']:.3f} | "
                  f"{flop / ms['scaled_mm'] / 1e9:.0f} | {ms['bf16'] / ms['scaled_mm']:.2f} |")
        for name, call in _fp8_linear_passes(x, weight, grad_y, config).items():
            passes["fp8_linear"][name] += median_ms(call, repeats, warmup=3)
    print("\n| one layer | bf16 ms | _scaled_mm ms | fp8_linear ms (quantization included) | bf16 / fp8_linear |")
    print("|---|---|---|---|---|")
    for name in ("forward", "backward"):
        row = [passes[kind][name] for kind in ("bf16", "scaled_mm", "fp8_linear")]
        print(f"| {name} | {row[0]:.3f} | {row[1]:.3f} | {row[2]:.3f} | {row[0] / row[2]:.2f} |")
    overhead = sum(passes["fp8_linear"].values()) - sum(passes["scaled_mm"].values())
    print(f"quantization overhead: {overhead:.3f} ms per layer, {overhead * layers:.1f} ms per micro-batch of "
          f"{layers} layers (bf16 GEMMs: {sum(passes['bf16'].values()) * layers:.1f} ms)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--recipe", choices=fp8.FP8_RECIPES, default="tensorwise")
    parser.add_argument("--fp8-format", choices=fp8.FP8_FORMATS, default="hybrid")
    args = parser.parse_args(argv)
    refuse_non_positive(parser, args, "tokens", "repeats")
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_gemms.py needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    config = fp8.Fp8Config(format=args.fp8_format, recipe=args.recipe)
    with torch.no_grad():
        for model in MODELS:
            _print_model(model, args.tokens, args.repeats, config)


if __name__ == "__main__":
    main()
