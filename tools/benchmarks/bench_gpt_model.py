"""Forward + backward time of a GPT on one GPU, with model TFLOP/s and MFU (defined in docs/architecture.md).

Default: the 1.3B GPT (24 layers, hidden 2048, 16 heads, seq 2048, micro-batch 8,
padded vocab 50304, bf16), timed in five settings: no dropout, dropout 0.1, dropout 0.1
with activation checkpointing of every layer, and without dropout under selective recompute (the
default modules, then with core_attn too; ``--micro-batch-size 16`` is the case they are for). MFU divides model TFLOP/s (recomputation earns no
credit) by the bf16 peak of an 8192³ matmul measured in the same run. The optimizer step is not
included: this times the model's forward and backward only.

    python tools/benchmarks/bench_gpt_model.py [--num-layers 24 --hidden-size 2048 ...]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.dtypes import torch_dtype  # noqa: E402
from megatron.core.models.gpt import GPTModel, GPTModelConfig  # noqa: E402
from megatron.core.models.gpt.config import SELECTIVE_RECOMPUTE_DEFAULT  # noqa: E402
from megatron.core.parallel_state import single_rank_groups  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_seed  # noqa: E402
from megatron.training.matmul_peak import measure_matmul_peak_tflops  # noqa: E402
from megatron.training.throughput import compute_throughput  # noqa: E402

SETTINGS = (
    ("no dropout", dict(hidden_dropout=0.0, attention_dropout=0.0)),
    ("dropout 0.1", dict(hidden_dropout=0.1, attention_dropout=0.1)),
    ("dropout 0.1 + activation checkpointing",
     dict(hidden_dropout=0.1, attention_dropout=0.1, checkpoint_activations=True)),
    ("no dropout + selective recompute", dict(hidden_dropout=0.0, attention_dropout=0.0,
                                              recompute_modules=SELECTIVE_RECOMPUTE_DEFAULT)),
    ("no dropout + selective, core_attn too", dict(hidden_dropout=0.0, attention_dropout=0.0,
                                                   recompute_modules=("core_attn", *SELECTIVE_RECOMPUTE_DEFAULT))),
)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-layers", type=int, default=24)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-attention-heads", type=int, default=16)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--padded-vocab-size", type=int, default=50304)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--attention-impl", choices=["sdpa", "materialized"], default="sdpa")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    return parser.parse_args()


def model_config(args, **overrides):
    return GPTModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                          num_attention_heads=args.num_attention_heads,
                          padded_vocab_size=args.padded_vocab_size, seq_length=args.seq_length,
                          max_position_embeddings=args.seq_length, params_dtype=torch_dtype(args.dtype, "--dtype"),
                          attention_impl=args.attention_impl, **overrides)


def time_forward_backward(model, tokens, iters, warmup):
    """Mean seconds of one forward (to the loss) + backward, between CUDA events."""
    labels = torch.roll(tokens, -1, dims=1)
    loss_mask = torch.ones_like(tokens, dtype=torch.float32)

    def step():
        loss = model(tokens, labels=labels, loss_mask=loss_mask)
        loss.backward()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0 / iters


def run_setting(args, overrides, peak):
    config = model_config(args, **overrides)
    model_parallel_seed(1234, tp_rank=0, pp_rank=0)
    model = GPTModel(config, single_rank_groups(), device="cuda")
    tokens = torch.randint(0, args.padded_vocab_size, (args.micro_batch_size, args.seq_length), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    seconds = time_forward_backward(model, tokens, args.iters, args.warmup)
    throughput = compute_throughput(config, global_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                                    iteration_time=seconds, world_size=1, data_parallel_size=1,
                                    peak_tflops=peak)
    memory_gib = torch.cuda.max_memory_allocated() / 2**30
    del model
    torch.cuda.empty_cache()
    return seconds, throughput, memory_gib


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpt_model.py needs a CUDA GPU")
    peak = measure_matmul_peak_tflops("cuda")
    parameters = 12 * args.num_layers * args.hidden_size**2 + args.padded_vocab_size * args.hidden_size
    print(f"{torch.cuda.get_device_name()}: measured bf16 matmul peak {peak:.0f} TFLOP/s")
    print(f"GPT {parameters / 1e9:.2f}B: {args.num_layers} layers, hidden {args.hidden_size}, "
          f"{args.num_attention_heads} heads, seq {args.seq_length}, micro-batch {args.micro_batch_size}, "
          f"vocab {args.padded_vocab_size}, {args.dtype}, attention {args.attention_impl}")
    print(f"{'setting':<42}{'fwd+bwd (ms)':>14}{'model TFLOP/s':>15}{'MFU':>8}{'peak mem (GiB)':>16}")
    for name, overrides in SETTINGS:
        try:
            result = run_setting(args, overrides, peak)
        except torch.cuda.OutOfMemoryError:
            result = None
        if result is None:  # the failed setting's tensors are released once the exception is gone
            torch.cuda.empty_cache()
            print(f"{name:<42}{'out of memory':>14}")
            continue
        seconds, throughput, memory_gib = result
        print(f"{name:<42}{seconds * 1e3:>14.1f}{throughput.model_tflops:>15.1f}"
              f"{throughput.mfu:>8.1%}{memory_gib:>16.1f}")


if __name__ == "__main__":
    main()
