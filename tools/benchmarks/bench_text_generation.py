"""Text generation speed on one GPU: ours against transformers' ``generate`` on the same weights.

Models (``--model``; the shape flags override a model's values):

    gpt1p3b (default)  the 1.3B GPT: 24 layers, hidden 2048, 16 heads, learned positions, padded
                       vocabulary 50304 (GPT-2's 50257 ids), against GPT2LMHeadModel
    llama1p2b          a Llama-style 1.2B: 16 layers, hidden 2048, 32 heads over 8 key/value groups,
                       SwiGLU ffn 8192, RoPE base 500000, RMSNorm, untied output layer, no biases,
                       vocabulary 128256, against LlamaForCausalLM (issue 33's generation goal)

random weights in bf16, a random prompt of 128 tokens, then 256 new tokens, greedy, no early stop,
at batch 1 and 32. Timed, each after one untimed run:

    ours, growing cache       the key/value cache of kv_cache.LayerKVCache, every step from Python
    ours, static + graphs     fixed-size caches, each one-token step replayed from a CUDA graph
                              (the caches and the graph serve every call of the same shape, as
                              transformers keeps its static cache and compiled graphs)
    ours, ... + compiled      the same with a one-token step after the embedding compiled (torch.compile)
                              before the graph captures them
    transformers, static      the model's generate(cache_implementation="static"), sdpa attention,
                              with its automatic compilation disabled, and as it comes (it compiles
                              the decoding step when it can)

Before timing, at each batch size, a correctness check of each graph variant on the GPU: the logits
of a random 128 + 256-token sequence fed as prefill then one-token graph replays (teacher forcing)
against the --recompute path's (the whole sequence, no cache); the relative error ||a - b|| / ||b||
must stay within max(5 %, 2 x that of the eager static-cache path): bf16 rounding through 24 layers
(a compiled step rounds elsewhere: 1.5 % seen on CPU for 24 narrow layers), where a wrong position,
mask or cache entry gives errors of order 1. A failed check
makes the exit status 1. ``--profile-dir`` writes torch.profiler's GPU kernel table of one call of
each graph variant per batch size (``profile_batch<b>.txt``). ``--attention-backends`` times one
decode step's attention (one query over the 384-position cache, 256 positions filled) under each
of torch's sdpa backends, replayed from a CUDA graph, and flash attention over the filled positions
only (no mask: what an exact-length decode kernel would read).

Reported: tokens per second (batch x new tokens / wall time of the whole call, prefill included),
our best over transformers' best, and whether the greedy tokens agree (bf16 rounding may part them
after a while; the first difference is printed). Batch-1 decode: seconds per new token
((t[256 tokens] - t[1 token]) / 255) against the memory-bandwidth bound = the bytes one decode step
must read (``decode_bytes_per_token``: every weight, but one row of the input word and position
tables where the output layer does not read them, plus the key/value cache of the mean context,
prompt + new tokens / 2) / the copy bandwidth measured here (a 2 GiB device-to-device copy reads and
writes each byte once).

    python tools/benchmarks/bench_text_generation.py [--model llama1p2b] [--batch-sizes 1 32]
        [--no-compiled-transformers] [--skip-growing-cache] [--profile-dir DIR] [--attention-backends]
"""
import argparse
import dataclasses
import os
import sys
import time
import traceback

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

# Per model: GPTModelConfig's fields (params_dtype and the shape flags' values join them), and the
# tokenizer's vocabulary ("vocab": prompts are drawn below it; as the end-of-document id it is never chosen)
MODELS = {
    "gpt1p3b": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, padded_vocab_size=50304,
                    max_positions=2048, vocab=50257),
    "llama1p2b": dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8,
                      ffn_hidden_size=8192, padded_vocab_size=128256, max_positions=4096, vocab=128256,
                      normalization="RMSNorm", glu_activation="swiglu", bias_gelu_fusion=False,
                      position_embedding_type="rotary", rotary_base=500000.0,
                      untie_embeddings_and_output_weights=True, add_bias_linear=False),
}
SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
               "padded_vocab_size", "max_positions")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt1p3b")
    for flag in SHAPE_FLAGS:
        parser.add_argument("--" + flag.replace("_", "-"), type=int, default=None, help="default: the model's")
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="fp32: CPU checks")
    parser.add_argument("--no-compiled-transformers", action="store_true",
                        help="skip transformers' compiled run (its compilation takes a minute or more)")
    parser.add_argument("--skip-growing-cache", action="store_true", help="skip our slowest variant")
    parser.add_argument("--profile-dir", help="write a kernel table of one call per graph variant and batch here")
    parser.add_argument("--attention-backends", action="store_true", help="time a decode step's attention per backend")
    args = parser.parse_args(argv)
    for flag in SHAPE_FLAGS:
        if getattr(args, flag) is None:
            setattr(args, flag, MODELS[args.model].get(flag))
    return args


def model_config(args) -> GPTModelConfig:
    """The --model's configuration with the shape flags' values, the --dtype, no dropout."""
    fields = {name: value for name, value in MODELS[args.model].items() if name not in ("max_positions", "vocab")}
    fields.update({flag: getattr(args, flag) for flag in SHAPE_FLAGS if flag != "max_positions"})
    return GPTModelConfig(**fields, seq_length=args.max_positions, max_position_embeddings=args.max_positions,
                          params_dtype=torch_dtype(args.dtype, "--dtype"), hidden_dropout=0.0, attention_dropout=0.0)


def build_stage(args, device="cuda") -> InferenceStage:
    model_parallel_seed(1234, 0, 0)
    return InferenceStage(model_config(args), single_rank_groups(), device=torch.device(device)).eval()


def decode_bytes_per_token(stage: InferenceStage, context: int) -> int:
    """Bytes one batch-1 decode step must read: every parameter, except that of the input word table
    (when the output layer is its own) and of a learned position table only one row, plus the keys and
    values of ``context`` positions in every layer (2 L g hn context elements)."""
    config = stage.config
    total = sum(p.numel() * p.element_size() for p in stage.parameters())
    one_row_tables = [stage.embedding.position_embeddings] if stage.embedding.position_embeddings is not None else []
    if stage.output_layer is not None:
        one_row_tables.append(stage.embedding.word_embeddings)
    for table in one_row_tables:
        for weight in table.parameters():
            total -= (weight.shape[0] - 1) * weight[0].numel() * weight.element_size()
    element = torch.empty((), dtype=config.params_dtype).element_size()
    return total + 2 * config.num_layers * config.num_query_groups * config.kv_channels * context * element


def transformers_model(stage: InferenceStage, vocab: int):
    """The transformers model that the exporter writes for the stage's weights (its per-layer mapping
    and config: GPT2LMHeadModel, LlamaForCausalLM, ...), the first ``vocab`` rows of the vocabulary,
    sdpa attention."""
    import transformers

    config = dataclasses.asdict(stage.config)
    layers = {}
    for name, tensor in stage.state_dict().items():
        layer, _, rest = pipeline_name(name, stage.config.num_layers).partition(".")
        index, local = (1, name.removeprefix("embedding.")) if layer == "tied_modules" else (int(layer), rest)
        layers.setdefault(index, {})[local] = tensor
    state = {}
    for layer, layer_state in layers.items():
        state.update(exported_layer(config, layer, layer_state, vocab))
    hf_config = transformers_config(config, vocab, stage.config.params_dtype)
    hf_config.pop("architectures")
    hf_config = transformers.AutoConfig.for_model(hf_config.pop("model_type"), **hf_config,
                                                  attn_implementation="sdpa")
    with torch.device(stage.embedding.word_embeddings.weight.device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
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


def ours(forward: PipelineForward, prompts: torch.Tensor, new_tokens: int, vocab: int):
    def run():
        output = generate(forward, prompts.tolist(), new_tokens, SamplingParams(greedy=True), eod=vocab,
                          vocab_size=vocab, max_length=prompts.shape[1] + new_tokens, device=prompts.device)
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


GRAPHS, COMPILED = "ours, static + graphs", "ours, static + graphs + compiled"


def our_variants(stage: InferenceStage, skip_growing: bool) -> dict[str, PipelineForward]:
    groups = single_rank_groups()
    variants = {} if skip_growing else {"ours, growing cache": PipelineForward(stage, groups)}
    variants[GRAPHS] = PipelineForward(stage, groups, static_cache=True, cuda_graphs=True)
    variants[COMPILED] = PipelineForward(stage, groups, static_cache=True, cuda_graphs=True, compiled_decode=True)
    return variants


def teacher_forced_logits(forward: PipelineForward, tokens: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """Logits [b, T - P, V] of positions P .. T - 1: prefill of the P prompt tokens, then one-token steps."""
    batch, total = tokens.shape
    caches = forward.new_caches(batch, total, tokens.device)
    forward.last_stage_logits(tokens[:, :prompt_length], 0, caches)
    steps = [forward.last_stage_logits(tokens[:, p:p + 1], p, caches) for p in range(prompt_length, total)]
    return torch.cat(steps, dim=1)


def relative_error(found: torch.Tensor, expected: torch.Tensor) -> float:
    return float((found - expected).norm() / expected.norm())


def check_graph_logits(stage: InferenceStage, variants: dict, tokens: torch.Tensor, prompt_length: int) -> bool:
    """The module docstring's check for every graph variant at this batch size; prints and returns pass."""
    groups = single_rank_groups()
    expected = PipelineForward(stage, groups).last_stage_logits(tokens)[:, prompt_length:]  # --recompute's
    eager = relative_error(teacher_forced_logits(PipelineForward(stage, groups, static_cache=True), tokens,
                                                 prompt_length), expected)
    tolerance = max(0.05, 2 * eager)
    passed = True
    for name in (GRAPHS, COMPILED):
        found = teacher_forced_logits(variants[name], tokens, prompt_length)
        error = relative_error(found, expected)
        agree = float((found.argmax(-1) == expected.argmax(-1)).float().mean())
        passed &= error <= tolerance
        print(f"batch {tokens.shape[0]:3d} | check {name} vs --recompute logits: relative error {error:.2e} "
              f"(eager static cache {eager:.2e}, tolerance {tolerance:.2e}), top-1 agreement {agree:.1%}: "
              f"{'ok' if error <= tolerance else 'FAILED'}", flush=True)
    return passed


def profile_calls(variants: dict, prompts: torch.Tensor, new_tokens: int, vocab: int, path: str) -> None:
    """torch.profiler over one call of each graph variant: the GPU kernel table and kernels per step."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as report:
        for name in (GRAPHS, COMPILED):
            run = ours(variants[name], prompts, new_tokens, vocab)
            run()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
                start = time.perf_counter()
                run()
                torch.cuda.synchronize()
                wall = time.perf_counter() - start
            device_ops = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            busy = sum(e.time_range.elapsed_us() for e in device_ops) / 1e6
            summary = (f"{name}, batch {prompts.shape[0]}: {len(device_ops)} GPU operations (kernels, copies), "
                       f"{len(device_ops) / new_tokens:.0f} per new token; GPU busy {busy:.3f} s of {wall:.3f} s "
                       f"wall (profiled)")
            print(summary, flush=True)
            report.write(summary + "\n")
            report.write(profiler.key_averages().table(sort_by="self_device_time_total", row_limit=25) + "\n\n")


def graph_replay_seconds(call, repeats: int = 50) -> float:
    """Seconds per call of ``call()`` captured ``repeats`` times in one CUDA graph (no launch cost)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            call()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (10 * repeats)


def attention_backend_times(args, batch: int, filled: int = 256) -> None:
    """Microseconds of one decode step's attention per sdpa backend (module docstring)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, head_dim = args.num_attention_heads, args.hidden_size // args.num_attention_heads
    capacity = args.prompt_length + args.new_tokens
    dtype = torch_dtype(args.dtype, "--dtype")
    query = torch.randn(batch, heads, 1, head_dim, device="cuda", dtype=dtype)
    keys, values = (torch.randn(batch, heads, capacity, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    allowed = (torch.arange(capacity, device="cuda") < filled)[None, None, None]  # [1, 1, 1, capacity]
    cases = {backend.name: (backend, keys, values, allowed) for backend in
             (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)}
    cases["FLASH_ATTENTION, filled positions only"] = (SDPBackend.FLASH_ATTENTION, keys[:, :, :filled],
                                                       values[:, :, :filled], None)
    for name, (backend, k, v, mask) in cases.items():
        def call():
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask)
        try:
            print(f"batch {batch:3d} | attention of one decode step, {name}: "
                  f"{graph_replay_seconds(call) * 1e6:.1f} us", flush=True)
        except RuntimeError as error:
            print(f"batch {batch:3d} | attention of one decode step, {name}: not available ({error})".splitlines()[0])


def report_decode_bound(stage: InferenceStage, variant: str, per_token: float, context: int) -> None:
    """Prints batch-1 decode seconds per token against the memory-bandwidth bound (module docstring)."""
    read = decode_bytes_per_token(stage, context)
    cache = read - decode_bytes_per_token(stage, 0)
    bandwidth = copy_bandwidth()
    bound = read / bandwidth
    print(f"batch   1 | decode ({variant}) {per_token * 1e3:.3f} ms/token; bound {bound * 1e3:.3f} ms/token "
          f"({read / 1e9:.3f} GB read per token, {cache / 1e9:.3f} GB of it the key/value cache of {context} "
          f"positions, over a measured copy bandwidth of {bandwidth / 1e12:.2f} TB/s): "
          f"{bound / per_token:.0%} of the memory-bandwidth bound", flush=True)


def timed_or_none(run):
    """timed(run), or None after printing the error (one variant failing leaves the others' figures)."""
    try:
        return timed(run)
    except Exception:  # noqa: BLE001 - reported, and the exit status says so
        traceback.print_exc()
        return None


def time_batch(args, variants: dict, hf_model, prompts: torch.Tensor, vocab: int) -> tuple[dict, str | None]:
    """Times every variant at this batch and prints the table: ({name: (seconds, tokens)} of those that
    ran, the fastest of ours or None)."""
    batch = prompts.shape[0]
    results = {name: timed_or_none(ours(forward, prompts, args.new_tokens, vocab))
               for name, forward in variants.items()}
    results["transformers, static, eager"] = timed_or_none(theirs(hf_model, prompts, args.new_tokens, compiled=False))
    if not args.no_compiled_transformers:
        results["transformers, static, compiled"] = timed_or_none(theirs(hf_model, prompts, args.new_tokens,
                                                                         compiled=True))
    ran = {name: result for name, result in results.items() if result is not None}
    reference = ran.get("transformers, static, eager", (None, None))[1]
    for name, (seconds, tokens) in ran.items():
        agreement = "no eager run" if reference is None else first_difference(tokens, reference)
        print(f"batch {batch:3d} | {name:34s} | {batch * args.new_tokens / seconds:10.1f} tokens/s | "
              f"{seconds:7.3f} s | vs transformers eager: {agreement}", flush=True)
    mine = [name for name in ran if name.startswith("ours")]
    theirs_ran = [ran[name][0] for name in ran if name.startswith("transformers")]
    best_ours = min(mine, key=lambda name: ran[name][0]) if mine else None
    if best_ours is not None and theirs_ran:
        print(f"batch {batch:3d} | ours / transformers (best of each): {min(theirs_ran) / ran[best_ours][0]:.2f}x "
              f"({best_ours})", flush=True)
    return results, best_ours


def optional(step) -> bool:
    """Runs step(): False if it returned False or failed (its error printed), else True."""
    try:
        return step() is not False
    except Exception:  # noqa: BLE001 - reported, and the exit status says so
        traceback.print_exc()
        return False


def main():
    args = parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    stage = build_stage(args)
    vocab = MODELS[args.model]["vocab"]
    parameter_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())
    print(f"model {args.model}: {sum(p.numel() for p in stage.parameters()) / 1e9:.3f}B parameters "
          f"({parameter_bytes / 2**30:.2f} GiB {args.dtype}); prompt {args.prompt_length}, "
          f"{args.new_tokens} new tokens", flush=True)
    hf_model = transformers_model(stage, vocab)
    variants = our_variants(stage, args.skip_growing_cache)
    generator = torch.Generator(device="cuda").manual_seed(0)
    healthy = True
    for batch in args.batch_sizes:
        total = args.prompt_length + args.new_tokens
        check_tokens = torch.randint(0, vocab, (batch, total), device="cuda", generator=generator)
        healthy &= optional(lambda: check_graph_logits(stage, variants, check_tokens, args.prompt_length))
        prompts = torch.randint(0, vocab, (batch, args.prompt_length), device="cuda", generator=generator)
        results, best_ours = time_batch(args, variants, hf_model, prompts, vocab)
        healthy &= best_ours is not None and all(result is not None for result in results.values())
        if args.profile_dir:
            path = os.path.join(args.profile_dir, f"profile_batch{batch}.txt")
            healthy &= optional(lambda: profile_calls(variants, prompts, args.new_tokens, vocab, path))
        if batch == 1 and best_ours is not None:
            one_token, _ = timed(ours(variants[best_ours], prompts, 1, vocab))
            per_token = (results[best_ours][0] - one_token) / (args.new_tokens - 1)
            report_decode_bound(stage, best_ours, per_token, args.prompt_length + args.new_tokens // 2)
        if args.attention_backends:
            healthy &= optional(lambda: attention_backend_times(args, batch))
    sys.exit(0 if healthy else 1)


if __name__ == "__main__":
    main()
