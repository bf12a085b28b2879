"""Training throughput of the strongest peer (transformers under torch.compile) against our trainer's logs.

The peer trains the same shapes as the trainer's runs (tests/gpu/run_trainer.sh's peer runs),
sdpa attention, the vocabulary padded like ours, fp32 weights under bf16 autocast, fused AdamW
(lr 1e-4, betas 0.9 / 0.95, weight decay 0.1), gradients accumulated over the trainer run's global
batch before each optimizer step, its model compiled with ``torch.compile``:

    1p3b, 350m   GPT2LMHeadModel: learned positions, GeLU (tanh), seq 2048, vocabulary 50304, global
                 batch 32 (1.3B) or 64 (350M)
    llama1p2b    LlamaForCausalLM: 16 layers, hidden 2048, 32 heads over 8 key/value groups, SwiGLU
                 ffn 8192, RoPE base 500000, RMSNorm, untied output layer, no biases, seq 4096,
                 vocabulary 128256, global batch 16. The trainer's data are the GPT-2 BPE ids of the
                 sample corpus (run_trainer.sh's 32000-token tokenizer): every id fits in the 128256-row
                 vocabulary, and a speed benchmark needs no Llama tokenizer (the peer reads random ids).

Each of the peer's candidate micro-batches is timed (steady state, after warm-up and compilation)
and the best counts, as the peer's user would pick it; a micro-batch that runs out of memory drops
out. Ours likewise is the best of its runs given (one log per micro-batch). Model TFLOP/s use the
trainer's count for both (megatron.core.flops.model_flops_per_iteration through
megatron/training/throughput.py: Megatron-LM's formula, key/value projections of g x hn and the GLU's
doubled first MLP matmul included), so the ratio is a ratio of tokens/s.

    python3 tools/benchmarks/bench_vs_peer.py --ours 1p3b=trainer_1p3b.log --ours llama1p2b=a.log,b.log

``--ours NAME=LOG[,LOG...]`` names a model of MODELS and the trainer logs of it (each: the mean model
TFLOP/s of the iterations after ``--skip``; the best counts); tools/benchmarks/bench_vs_peer.sh runs
the trainer and then this script.
"""
import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.models.gpt import GPTModelConfig  # noqa: E402
from megatron.training.throughput import model_flops  # noqa: E402
from tools.benchmarks.scaling_table import steady_state  # noqa: E402


LLAMA_ROPE_BASE = 500000.0


@dataclass(frozen=True)
class PeerModel:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    micro_batches: tuple[int, ...]  # the peer's candidates, best picked
    global_batch: int  # sequences per optimizer step, as in the trainer's run
    seq_length: int = 2048
    padded_vocab_size: int = 50304
    llama: bool = False  # LlamaForCausalLM's layers (module docstring) instead of GPT-2's
    ffn_hidden_size: int | None = None  # default 4h
    num_query_groups: int | None = None  # key/value groups; default one per head


MODELS = {
    "1p3b": PeerModel(24, 2048, 16, (16, 32, 8, 4), 32),
    "350m": PeerModel(24, 1024, 16, (8, 16, 32), 64),
    "llama1p2b": PeerModel(16, 2048, 32, (4, 2, 1), 16, seq_length=4096, padded_vocab_size=128256, llama=True,
                           ffn_hidden_size=8192, num_query_groups=8),
}


def gpt_config(model: PeerModel, seq_length: int, vocab_size: int) -> GPTModelConfig:
    """Our model of the peer's shapes (what the trainer's run builds), for the FLOP count."""
    llama = {}
    if model.llama:
        llama = dict(normalization="RMSNorm", glu_activation="swiglu", bias_gelu_fusion=False,
                     position_embedding_type="rotary", rotary_base=LLAMA_ROPE_BASE,
                     untie_embeddings_and_output_weights=True, add_bias_linear=False)
    return GPTModelConfig(num_layers=model.num_layers, hidden_size=model.hidden_size,
                          num_attention_heads=model.num_attention_heads, padded_vocab_size=vocab_size,
                          seq_length=seq_length, max_position_embeddings=seq_length,
                          ffn_hidden_size=model.ffn_hidden_size, num_query_groups=model.num_query_groups, **llama)


def peer_model(model: PeerModel, seq_length: int, vocab_size: int, device) -> torch.nn.Module:
    import transformers

    if model.llama:
        config = transformers.LlamaConfig(
            vocab_size=vocab_size, hidden_size=model.hidden_size, intermediate_size=model.ffn_hidden_size,
            num_hidden_layers=model.num_layers, num_attention_heads=model.num_attention_heads,
            num_key_value_heads=model.num_query_groups or model.num_attention_heads,
            max_position_embeddings=seq_length, rope_theta=LLAMA_ROPE_BASE, rms_norm_eps=1e-5,
            tie_word_embeddings=False, attention_bias=False, mlp_bias=False, attention_dropout=0.0,
            attn_implementation="sdpa")
        return transformers.LlamaForCausalLM(config).to(device)
    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=seq_length, n_embd=model.hidden_size,
                                     n_layer=model.num_layers, n_head=model.num_attention_heads,
                                     activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(config).to(device)


def peer_step_seconds(module: torch.nn.Module, micro_batch: int, accumulation: int, seq_length: int,
                      vocab_size: int, *, compile_model: bool, warmup: int, iters: int) -> float:
    """Mean seconds of one training step of the peer: ``accumulation`` forward-backward passes of
    ``micro_batch`` sequences, then AdamW."""
    device = next(module.parameters()).device
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device.type == "cuda")
    forward = torch.compile(module) if compile_model else module
    tokens = torch.randint(0, vocab_size, (micro_batch, seq_length), device=device)

    def step():
        for _ in range(accumulation):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = forward(input_ids=tokens, labels=tokens).loss / accumulation
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    synchronize()
    return (time.perf_counter() - start) / iters


def peer_best(model: PeerModel, args, device) -> tuple[float, int]:
    """(best model TFLOP/s, its micro-batch) over the candidates that fit in memory."""
    best = (0.0, 0)
    seq_length = args.seq_length or model.seq_length
    vocab_size = args.padded_vocab_size or model.padded_vocab_size
    for micro_batch in args.peer_micro_batches or model.micro_batches:
        module = None
        accumulation = max(1, model.global_batch // micro_batch)
        try:
            module = peer_model(model, seq_length, vocab_size, device)
            seconds = peer_step_seconds(module, micro_batch, accumulation, seq_length, vocab_size,
                                        compile_model=not args.no_compile, warmup=args.warmup, iters=args.iters)
        except Exception as error:  # noqa: BLE001 - torch.compile wraps an out-of-memory error in its own
            if "out of memory" not in str(error).lower():
                raise
            print(f"peer micro-batch {micro_batch}: out of memory")
            seconds = math.inf
        finally:
            del module
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        flops = model_flops(gpt_config(model, seq_length, vocab_size), micro_batch * accumulation, seq_length)
        tflops = flops / seconds / 1e12
        print(f"peer seq {seq_length} micro-batch {micro_batch} x {accumulation}: "
              f"{seconds * 1e3:.1f} ms/step, {tflops:.1f} model TFLOP/s")
        best = max(best, (tflops, micro_batch))
    return best


def ratio_rows(results: list[tuple[str, float, float, int]]) -> list[str]:
    """Markdown rows of (model, ours, peer's best, its micro-batch): ours / peer."""
    lines = ["| model | ours: model TFLOP/s | peer (transformers + torch.compile): model TFLOP/s | "
             "peer micro-batch | ours / peer |", "|---|---|---|---|---|"]
    for name, ours, peer, micro_batch in results:
        ratio = f"{ours / peer:.2f}x" if peer > 0 else "peer ran out of memory"
        lines.append(f"| {name} | {ours:.1f} | {peer:.1f} | {micro_batch} | {ratio} |")
    return lines


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ours", action="append", required=True,
                        help="NAME=LOG[,LOG...], NAME one of " + ", ".join(MODELS))
    parser.add_argument("--skip", type=int, default=3, help="warm-up iterations of the trainer logs left out")
    parser.add_argument("--seq-length", type=int, default=None, help="the peer's sequence (default: the model's)")
    parser.add_argument("--padded-vocab-size", type=int, default=None,
                        help="the peer's vocabulary (default: the model's)")
    parser.add_argument("--peer-micro-batches", type=int, nargs="+", default=None,
                        help="the peer's candidate micro-batches (default: per model, see MODELS)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--no-compile", action="store_true", help="the peer in eager mode (CPU checks)")
    return parser.parse_args(argv)


def ours_best(name: str, paths: list[str], skip: int) -> float:
    """The best mean model TFLOP/s over the trainer logs ``paths`` (one per micro-batch); each printed."""
    best = 0.0
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as log:
                state = steady_state(name, log.read(), skip)
        except OSError as error:
            sys.exit(f"--ours {name}: cannot read the trainer log {path!r} ({error.strerror})")
        if state is None:  # e.g. a micro-batch that did not fit in memory
            print(f"ours {name} {path}: no iteration line after iteration {skip}")
            continue
        print(f"ours {name} {path}: {state.model_tflops_per_gpu:.1f} model TFLOP/s")
        best = max(best, state.model_tflops_per_gpu)
    if best == 0.0:
        sys.exit(f"--ours {name}: none of {paths} has an iteration line after iteration {skip}")
    return best


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = []
    for run in args.ours:
        name, _, paths = run.partition("=")
        if name not in MODELS:
            sys.exit(f"--ours {run!r}: model {name!r} is not one of {sorted(MODELS)}")
        ours = ours_best(name, paths.split(","), args.skip)
        peer, micro_batch = peer_best(MODELS[name], args, device)
        results.append((name, ours, peer, micro_batch))
    print("\n".join(ratio_rows(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
