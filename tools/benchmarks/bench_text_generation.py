"""Text generation speed on one GPU: ours against transformers' ``generate`` on the same weights.

Default: the 1.3B GPT (24 layers, hidden 2048, 16 heads, learned positions, padded vocabulary
50304, bf16), a random prompt of 128 tokens, then 256 new tokens, greedy, no early stop, at batch
1 and 32. Timed, each after one untimed run:

    ours, growing cache       the key/value cache of kv_cache.LayerKVCache, every step from Python
    ours, static + graphs     fixed-size caches, each one-token step replayed from a CUDA graph
                              (captured inside every timed call: capture cost included)
    transformers, static      GPT2LMHeadModel.generate(cache_implementation="static"), sdpa attention,
                              with its automatic compilation disabled, and as it comes (it compiles
                              the decoding step when it can)

Reported: tokens per second (batch x new tokens / wall time of the whole call, prefill included),
our best over transformers' best, and whether the greedy tokens agree (bf16 rounding may part them
after a while; the first difference is printed). Batch-1 decode: seconds per new token
((t[256 tokens] - t[1 token]) / 255) against the memory-bandwidth bound = parameter bytes / copy
bandwidth measured here (a 2 GiB device-to-device copy reads and writes each byte once).

    python tools/benchmarks/bench_text_generation.py [--batch-sizes 1 32] [--no-compiled-transformers]
"""
import argparse
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.checkpoint.names import pipeline_name  # noqa: E402
from megatron.core.checkpoint.transformers_export import exported_layer, transformers_config  # noqa: E402
from megatron.core.dtypes import torch_dtype  # noqa: E402
from megatron.core.models.gpt import GPTModelConfig  # noqa: E402
from megatron.core.parallel_state import single_rank_groups  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_seed  # noqa: E402
from megatron.core.text_generation.forward import PipelineForward  # noqa: E402
from megatron.core.text_generation.generation import generate  # noqa: E402
from megatron.core.text_generation.sampling import SamplingParams  # noqa: E402
from megatron.core.text_generation.stage_model import InferenceStage  # noqa: E402

VOCAB = 50257  # GPT-2's; the rows up to the padded size are never chosen


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-layers", type=int, default=24)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-attention-heads", type=int, default=16)
    parser.add_argument("--padded-vocab-size", type=int, default=50304)
    parser.add_argument("--max-positions", type=int, default=2048)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--no-compiled-transformers", action="store_true",
                        help="skip transformers' compiled run (its compilation takes a minute or more)")
    return parser.parse_args()


def build_stage(args) -> InferenceStage:
    config = GPTModelConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                            num_attention_heads=args.num_attention_heads, padded_vocab_size=args.padded_vocab_size,
                            seq_length=args.max_positions, max_position_embeddings=args.max_positions,
                            params_dtype=torch_dtype(args.dtype, "--dtype"), hidden_dropout=0.0,
                            attention_dropout=0.0)
    model_parallel_seed(1234, 0, 0)
    return InferenceStage(config, single_rank_groups(), device=torch.device("cuda")).eval()


def transformers_model(stage: InferenceStage):
    """GPT2LMHeadModel holding the stage's weights (the exporter's per-layer mapping), sdpa attention."""
    import transformers

    config = dataclasses.asdict(stage.config)
    layers = {}
    for name, tensor in stage.state_dict().items():
        layer, _, rest = pipeline_name(name, stage.config.num_layers).partition(".")
        index, local = (1, name.removeprefix("embedding.")) if layer == "tied_modules" else (int(layer), rest)
        layers.setdefault(index, {})[local] = tensor
    state = {}
    for layer, layer_state in layers.items():
        state.update(exported_layer(config, layer, layer_state, VOCAB))
    hf_config = transformers_config(config, VOCAB, stage.config.params_dtype)
    hf_config.pop("architectures")
    with torch.device(stage.embedding.word_embeddings.weight.device):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_config, attn_implementation="sdpa"))
    model = model.to(dtype=stage.config.params_dtype).eval()
    model.load_state_dict(state, strict=False)
    return model


def timed(run) -> tuple[float, torch.Tensor]:
    """(seconds, output) of run(), after one untimed call."""
    run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    output = run()
    torch.cuda.synchronize()
    return time.perf_counter() - start, output


def ours(forward: PipelineForward, prompts: torch.Tensor, new_tokens: int):
    def run():
        output = generate(forward, prompts.tolist(), new_tokens, SamplingParams(greedy=True), eod=VOCAB,
                          vocab_size=VOCAB, max_length=prompts.shape[1] + new_tokens, device=prompts.device)
        return output.tokens[:, prompts.shape[1]:]
    return run


def theirs(model, prompts: torch.Tensor, new_tokens: int, compiled: bool):
    def run():
        output = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                                pad_token_id=0, eos_token_id=None, disable_compile=not compiled)
        return output[:, prompts.shape[1]:]
    return run


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy (read + write)."""
    source = torch.empty(2**30, dtype=torch.int16, device="cuda")
    target = torch.empty_like(source)
    target.copy_(source)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        target.copy_(source)
    torch.cuda.synchronize()
    return 2 * 2 * source.numel() * 10 / (time.perf_counter() - start)


def first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    different = (a != b).any(dim=0).nonzero()
    return "all equal" if different.numel() == 0 else f"first difference at new token {int(different[0])}"


def main():
    args = parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    stage = build_stage(args)
    parameter_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())
    print(f"model: {sum(p.numel() for p in stage.parameters()) / 1e9:.3f}B parameters ({parameter_bytes / 2**30:.2f} GiB "
          f"{args.dtype}); prompt {args.prompt_length}, {args.new_tokens} new tokens", flush=True)
    hf_model = transformers_model(stage)
    variants = {"ours, growing cache": PipelineForward(stage, single_rank_groups()),
                "ours, static + graphs": PipelineForward(stage, single_rank_groups(), static_cache=True,
                                                         cuda_graphs=True)}
    generator = torch.Generator(device="cuda").manual_seed(0)
    for batch in args.batch_sizes:
        prompts = torch.randint(0, VOCAB, (batch, args.prompt_length), device="cuda", generator=generator)
        results = {}
        for name, forward in variants.items():
            results[name] = timed(ours(forward, prompts, args.new_tokens))
        results["transformers, static, eager"] = timed(theirs(hf_model, prompts, args.new_tokens, compiled=False))
        if not args.no_compiled_transformers:
            results["transformers, static, compiled"] = timed(theirs(hf_model, prompts, args.new_tokens, compiled=True))
        graphs, growing = results["ours, static + graphs"][1], results["ours, growing cache"][1]
        print(f"batch {batch:3d} | ours: static + graphs vs growing cache: {first_difference(graphs, growing)}")
        reference = results["transformers, static, eager"][1]
        for name, (seconds, tokens) in results.items():
            print(f"batch {batch:3d} | {name:32s} | {batch * args.new_tokens / seconds:10.1f} tokens/s | "
                  f"{seconds:7.3f} s | vs transformers eager: {first_difference(tokens, reference)}", flush=True)
        best_ours = min(results[name][0] for name in variants)
        best_theirs = min(seconds for name, (seconds, _) in results.items() if name.startswith("transformers"))
        print(f"batch {batch:3d} | ours / transformers (best of each): {best_theirs / best_ours:.2f}x", flush=True)
        if batch == 1:
            fast = variants["ours, static + graphs"]
            one_token, _ = timed(ours(fast, prompts, 1))
            per_token = (results["ours, static + graphs"][0] - one_token) / (args.new_tokens - 1)
            bandwidth = copy_bandwidth()
            bound = parameter_bytes / bandwidth
            print(f"batch   1 | decode {per_token * 1e3:.3f} ms/token; bound {bound * 1e3:.3f} ms/token "
                  f"({parameter_bytes / 1e9:.2f} GB over a measured copy bandwidth of {bandwidth / 1e12:.2f} TB/s): "
                  f"{bound / per_token:.0%} of the memory-bandwidth bound", flush=True)


if __name__ == "__main__":
    main()
