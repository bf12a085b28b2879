"""Activation bytes one transformer layer keeps for backward, per component and recompute mode (CPU).

Runs one ParallelTransformerLayer forward under ``torch.autograd.graph.saved_tensors_hooks``, records
every tensor autograd saves with the component running at the time (the innermost submodule, or the
layer itself for the fused bias-dropout-adds), and sums the bytes of each distinct storage
(parameters excluded). What selective recompute keeps as a recipe never reaches these hooks. Dividing by s·b·h gives bytes per element of the [s, b, h] hidden states, which does not
depend on the micro-batch and, with flash/sdpa attention (no s x s scores kept), barely on s: the
per-layer bytes of any shape of the same ratios are that figure times s·b·h.

Default: the 1.3B GPT's ratios scaled down (hidden 256, 2 heads of 128 channels as in the 1.3B,
ffn 4h, seq 256, micro-batch 2, bf16, no dropout as in the GPU benchmark runs).

    python tools/benchmarks/recompute_saved_bytes.py [--hidden-size 256 --seq-length 256 ...]
"""
import argparse
import dataclasses
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.dtypes import torch_dtype  # noqa: E402
from megatron.core.models.gpt.config import GPTModelConfig  # noqa: E402
from megatron.core.models.gpt.transformer_layer import ParallelTransformerLayer  # noqa: E402
from megatron.core.parallel_state import single_rank_groups  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_seed  # noqa: E402

MODES = (
    ("none", ()),
    ("core_attn", ("core_attn",)),
    ("layernorm", ("layernorm",)),
    ("mlp_act", ("mlp_act",)),
    ("mlp", ("mlp",)),
    ("layernorm+mlp_act", ("layernorm", "mlp_act")),
    ("core_attn+layernorm+mlp_act", ("core_attn", "layernorm", "mlp_act")),
)
COMPONENTS = ("input_layernorm", "self_attention.query_key_value", "self_attention", "self_attention.dense",
              "post_attention_layernorm", "mlp.dense_h_to_4h", "mlp", "mlp.dense_4h_to_h", "layer")


def saved_bytes_by_component(layer: torch.nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict:
    """{component: bytes kept for backward} after one forward of ``layer`` on ``hidden``."""
    stack = ["layer"]

    def leave(module, args, output):
        stack.pop()

    handles = []
    for name, module in layer.named_modules():
        if name and name in COMPONENTS:
            handles.append(module.register_forward_pre_hook(lambda m, a, name=name: stack.append(name)))
            handles.append(module.register_forward_hook(leave))
    parameters = {p.data_ptr() for p in layer.parameters()}
    saved = {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in parameters and pointer not in saved:
            saved[pointer] = (stack[-1], tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = layer(hidden, position_ids)
    for handle in handles:
        handle.remove()
    totals = defaultdict(int)
    for component, tensor in saved.values():
        totals[component] += tensor.untyped_storage().nbytes()
    output.float().sum().backward()  # the freed storages are refilled and used: the recompute runs
    return dict(totals)


def measure(config: GPTModelConfig, micro_batch_size: int) -> dict:
    """{mode name: {component: bytes}} for one layer of ``config`` in every mode of MODES."""
    results = {}
    for name, modules in MODES:
        model_parallel_seed(1234, tp_rank=0, pp_rank=0)
        layer = ParallelTransformerLayer(dataclasses.replace(config, recompute_modules=modules), 1,
                                         single_rank_groups()).train()
        hidden = torch.randn(config.seq_length, micro_batch_size, config.hidden_size,
                             dtype=config.params_dtype, requires_grad=True)
        position_ids = torch.arange(config.seq_length).expand(micro_batch_size, config.seq_length)
        results[name] = saved_bytes_by_component(layer, hidden, position_ids)
    return results


def print_table(results: dict, elements: int) -> None:
    """Bytes per [s, b, h] element, components as rows, modes as columns."""
    names = list(results)
    print(f"{'component':32s}" + "".join(f"{name:>30s}" for name in names))
    for component in COMPONENTS:
        row = [results[name].get(component, 0) / elements for name in names]
        print(f"{component:32s}" + "".join(f"{value:30.2f}" for value in row))
    print(f"{'total':32s}" + "".join(f"{sum(results[name].values()) / elements:30.2f}" for name in names))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--position-embedding-type", default="absolute", choices=("absolute", "rotary"))
    parser.add_argument("--swiglu", action="store_true", help="SwiGLU MLP without biases (Llama-style)")
    args = parser.parse_args()
    glu = dict(glu_activation="swiglu", bias_gelu_fusion=False, add_bias_linear=False,
               normalization="RMSNorm") if args.swiglu else {}
    config = GPTModelConfig(num_layers=1, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                            padded_vocab_size=128, seq_length=args.seq_length,
                            max_position_embeddings=None if args.position_embedding_type == "rotary"
                            else args.seq_length, position_embedding_type=args.position_embedding_type,
                            hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch_dtype(args.dtype),
                            use_cpu_initialization=True, **glu)
    results = measure(config, args.micro_batch_size)
    print(f"bytes kept per layer / (s·b·h), s={args.seq_length} b={args.micro_batch_size} h={args.hidden_size} "
          f"{args.dtype} {args.position_embedding_type}{' swiglu' if args.swiglu else ''}")
    print_table(results, args.seq_length * args.micro_batch_size * args.hidden_size)


if __name__ == "__main__":
    main()
