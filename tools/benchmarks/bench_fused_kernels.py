"""Fused kernels against their torch references on one GPU: max errors and speed-ups.

For each kernel at the shapes of a 1.3B GPT (seq 2048, micro-batch 8, hidden 2048, 16 heads,
ffn 8192; softmax at micro-batch 4) and each dtype:

- errors: max |fast - reference| of the forward output and of the activation gradient, max
  |fast - ref| / max |ref| of parameter gradients, and both forward outputs' max error against a
  float64 evaluation of the formula (so a larger fast-vs-ref error can be told from a less accurate one);
- time of the forward and of forward + backward, fast (the public op, which takes the Triton
  path) vs the reference in torch eager, and the speed-up, on two clocks: "eager", CUDA events
  around each call (L2 flushed between runs by triton's do_bench), which includes launch gaps
  where the host is slower than the GPU; and "graph", the call replayed from a CUDA graph, GPU
  time alone. Also the host time per call, and the fast version's bandwidth over the fewest bytes
  the op must move (each input read once, each output written once; causal softmax reads half).

    python3 tools/benchmarks/bench_fused_kernels.py [--dtypes bf16 fp16] [--cases layer_norm ...] [--sweep] [--compile]

``--cases qkv_split`` (run also without ``--cases``) times the query/key/value split's backward,
multi-head and grouped-query, against the reference's autograd.

``--sweep`` instead times launch configurations of the Triton kernels (block shapes, warps);
``--compile`` adds torch.compile of the reference as a third contender.
"""
import argparse
import importlib
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from megatron.core import fused_kernels
from megatron.core.dtypes import DTYPES
from megatron.core.fused_kernels import reference, selection

SEQ, MICRO_BATCH, HIDDEN, HEADS, FFN = 2048, 8, 2048, 16, 8192
SOFTMAX_BATCH = 4
DROPOUT = 0.1
EPS = 1e-5


@dataclass
class Case:
    """One kernel at one shape: inputs maker, the two contenders, a float64 truth, byte counts."""

    name: str
    make_inputs: Callable  # dtype -> list of tensors (or None), gradients wanted where requires_grad
    fast: Callable
    ref: Callable
    truth: Callable  # float64 forward from the inputs
    forward_bytes: int  # per element of the first input's dtype size
    backward_bytes: int


def _randn(*shape, dtype, scale=1.0, shift=0.0, grad=True):
    return (torch.randn(shape, device="cuda") * scale + shift).to(dtype).requires_grad_(grad)


def _softmax_case(causal):
    shape = (SOFTMAX_BATCH, HEADS, SEQ, SEQ)
    n = math.prod(shape)
    mask = None if causal else torch.rand(SOFTMAX_BATCH, 1, SEQ, SEQ, device="cuda") < 0.1
    scale = 1 / math.sqrt(HIDDEN // HEADS)
    # causal: reads the lower half, writes all; masked: reads scores and (broadcast) mask, writes probs
    forward_bytes = (1.5 * n, None) if causal else (2 * n, n // HEADS)
    backward_bytes = 2 * n if causal else 3 * n
    return Case(
        name="softmax causal" if causal else "softmax masked",
        make_inputs=lambda dtype: [_randn(*shape, dtype=dtype, scale=4.0)],
        fast=lambda s: fused_kernels.scale_mask_softmax(s, mask, scale, causal, True),
        ref=lambda s: reference.scale_mask_softmax_reference(s, mask, scale, causal, True),
        truth=lambda s: reference.scale_mask_softmax_reference(s.double(), mask, scale, causal, True),
        forward_bytes=forward_bytes,
        backward_bytes=backward_bytes,
    )


def _layer_norm_case():
    n = SEQ * MICRO_BATCH * HIDDEN
    return Case(
        name="layer_norm",
        make_inputs=lambda dtype: [
            _randn(SEQ, MICRO_BATCH, HIDDEN, dtype=dtype, scale=2.0, shift=0.5),
            _randn(HIDDEN, dtype=dtype, scale=0.1, shift=1.0),
            _randn(HIDDEN, dtype=dtype, scale=0.1),
        ],
        fast=lambda x, w, b: fused_kernels.layer_norm(x, w, b, EPS),
        ref=lambda x, w, b: reference.layer_norm_reference(x, w, b, EPS),
        truth=lambda x, w, b: reference.layer_norm_reference(x.double(), w.double(), b.double(), EPS),
        forward_bytes=(2 * n, None),
        backward_bytes=3 * n,
    )


def _rms_norm_case():
    n = SEQ * MICRO_BATCH * HIDDEN
    return Case(
        name="rms_norm",
        make_inputs=lambda dtype: [
            _randn(SEQ, MICRO_BATCH, HIDDEN, dtype=dtype, scale=2.0, shift=0.5),
            _randn(HIDDEN, dtype=dtype, scale=0.1, shift=1.0),
        ],
        fast=lambda x, w: fused_kernels.rms_norm(x, w, EPS),
        ref=lambda x, w: reference.rms_norm_reference(x, w, EPS),
        truth=lambda x, w: reference.rms_norm_reference(x.double(), w.double(), EPS),
        forward_bytes=(2 * n, None),
        backward_bytes=3 * n,
    )


def _bias_gelu_case():
    n = SEQ * MICRO_BATCH * FFN
    return Case(
        name="bias_gelu",
        make_inputs=lambda dtype: [_randn(FFN, dtype=dtype), _randn(SEQ, MICRO_BATCH, FFN, dtype=dtype, scale=2.0)],
        fast=fused_kernels.bias_gelu,
        ref=reference.bias_gelu_reference,
        truth=lambda b, y: reference.bias_gelu_reference(b.double(), y.double()),
        forward_bytes=(2 * n, None),
        backward_bytes=3 * n,
    )


def _bias_dropout_add_case():
    n = SEQ * MICRO_BATCH * HIDDEN
    return Case(
        name=f"bias_dropout_add p={DROPOUT}",
        make_inputs=lambda dtype: [
            _randn(SEQ, MICRO_BATCH, HIDDEN, dtype=dtype),
            _randn(HIDDEN, dtype=dtype),
            _randn(SEQ, MICRO_BATCH, HIDDEN, dtype=dtype),
        ],
        fast=lambda x, b, r: fused_kernels.bias_dropout_add(x, b, r, DROPOUT, True),
        ref=lambda x, b, r: reference.bias_dropout_add_reference(x, b, r, DROPOUT, True),
        truth=None,  # random: checked against the formula with the kernel's own mask instead
        forward_bytes=(3 * n, None),
        backward_bytes=2 * n,
    )


def _max_abs(a, b):
    return (a.double() - b.double()).abs().max().item()


def _run(fn, inputs, grad_out):
    """Output and input gradients of fn on fresh leaves of ``inputs``."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [None if t is None else t.grad for t in leaves]


def _errors(case, inputs):
    """(fwd max abs, activation-grad max abs, param-grad max rel, fast vs fp64, ref vs fp64)."""
    torch.manual_seed(1)
    with torch.no_grad():
        like = case.ref(*inputs)
    # dropout's mask is read off its gradient, so no gradient element may be 0
    grad_out = torch.rand_like(like) + 0.5 if case.truth is None else torch.randn_like(like)
    fast_out, fast_grads = _run(case.fast, inputs, grad_out)
    if case.truth is None:
        return _dropout_errors(inputs, fast_out, fast_grads, grad_out)
    ref_out, ref_grads = _run(case.ref, inputs, grad_out)
    activation = max(range(len(inputs)), key=lambda i: inputs[i].numel())
    param_rel = [
        _max_abs(f, r) / r.double().abs().max().item()
        for i, (f, r) in enumerate(zip(fast_grads, ref_grads))
        if i != activation
    ]
    truth = case.truth(*[t.detach() for t in inputs])
    return (
        _max_abs(fast_out, ref_out),
        _max_abs(fast_grads[activation], ref_grads[activation]),
        max(param_rel) if param_rel else float("nan"),
        _max_abs(fast_out, truth),
        _max_abs(ref_out, truth),
    )


def _dropout_errors(inputs, out, grads, grad_out):
    """Errors of bias_dropout_add against the formula with the kernel's own mask (from its gradient)."""
    x, bias, residual = (t.detach() for t in inputs)
    kept = grads[0] != 0
    truth = residual.double() + torch.where(kept, (x.double() + bias.double()) / (1 - DROPOUT), 0.0)
    expected_grad = torch.where(kept, grad_out.double() / (1 - DROPOUT), 0.0)
    bias_grad_truth = expected_grad.reshape(-1, bias.numel()).sum(0)
    bias_rel = _max_abs(grads[1], bias_grad_truth) / bias_grad_truth.abs().max().item()
    out_error = _max_abs(out, truth)
    return (_max_abs(out, truth.to(out.dtype)), _max_abs(grads[0], expected_grad.to(out.dtype)), bias_rel, out_error, float("nan"))


def _timed_call(fn, inputs, grad_out, backward):
    """The call to time: the forward (no autograd graph), or forward + backward to the inputs."""
    leaves = [t for t in inputs if t is not None and t.requires_grad]

    def forward():
        with torch.no_grad():
            return fn(*inputs)

    def forward_backward():
        return torch.autograd.grad(fn(*inputs), leaves, grad_out)

    return forward_backward if backward else forward


def _time_eager(call):
    """Median ms of CUDA events around each call (launch gaps count when the CPU is the bottleneck)."""
    from triton.testing import do_bench

    return do_bench(call, warmup=25, rep=200, return_mode="median")


def _time_graph(call):
    """Median ms of the call replayed from a CUDA graph: GPU time without the CPU's launch overhead."""
    from triton.testing import do_bench_cudagraph

    try:
        return do_bench_cudagraph(call, rep=100, return_mode="median")
    except Exception as error:  # report the contender as untimed rather than stop the table
        print(f"  CUDA graph capture failed: {type(error).__name__}: {error}", flush=True)
        return float("nan")


def _cpu_us(call, repeats=20):
    """Host microseconds per call, with the GPU queue drained before and after."""
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / repeats * 1e6


def _bytes(case, dtype):
    size = torch.finfo(dtype).bits // 8
    data, mask_bytes = case.forward_bytes
    forward = data * size + (mask_bytes or 0)
    return forward, forward + case.backward_bytes * size


def _check_fast_path(case, inputs):
    blocker = selection.runtime_blocker(*[t for t in inputs if t is not None])
    if blocker is not None:
        sys.exit(f"{case.name}: the fast path is blocked: {blocker}")


def _measure(case, inputs, grad_out, with_compile):
    """{(contender, clock, backward): ms or us} for eager, graph and CPU clocks."""
    contenders = {"fast": case.fast, "ref": case.ref}
    if with_compile:
        contenders["compiled"] = torch.compile(case.ref)
    times = {}
    for name, fn in contenders.items():
        for backward in (False, True):
            call = _timed_call(fn, inputs, grad_out, backward)
            times[(name, "eager", backward)] = _time_eager(call)
            if name != "compiled":
                times[(name, "graph", backward)] = _time_graph(call)
                times[(name, "cpu", backward)] = _cpu_us(call)
    return times


def benchmark(cases, dtypes, with_compile):
    rows = []
    for case in cases:
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            torch.manual_seed(0)
            inputs = case.make_inputs(dtype)
            _check_fast_path(case, inputs)
            errors = _errors(case, inputs)
            with torch.no_grad():
                grad_out = torch.randn_like(case.ref(*inputs))
            times = _measure(case, inputs, grad_out, with_compile)
            forward_bytes, total_bytes = _bytes(case, dtype)
            rows.append((case.name, dtype_name, errors, times, forward_bytes, total_bytes))
            print(f"done {case.name} {dtype_name}", flush=True)
            del inputs, grad_out
            torch.cuda.empty_cache()
    return rows


def _speed_columns(times, clock):
    """fwd fast, fwd ref, speed-up, f+b fast, f+b ref, speed-up."""
    columns = ""
    for backward in (False, True):
        fast, ref = times[("fast", clock, backward)], times[("ref", clock, backward)]
        columns += f"{fast:>9.3f}{ref:>9.3f}{ref / fast:>7.2f}"
    return columns


def print_tables(rows, with_compile):
    print("\nmax abs errors: fast vs reference; param rel = max|fast - ref| / max|ref| of weight/bias grads;")
    print("fast-f64 / ref-f64 = each forward output vs the float64 formula")
    print(f"{'kernel':<24}{'dtype':<6}{'fwd err':>10}{'bwd err':>10}{'param rel':>10}{'fast-f64':>10}{'ref-f64':>10}")
    for name, dtype_name, errors, *_ in rows:
        print(f"{name:<24}{dtype_name:<6}" + "".join(f"{e:>10.2e}" for e in errors))
    print("bias_dropout_add: errors against the formula with the kernel's own mask (read off its gradient)")
    print("\ntimes in ms (median); eager = CUDA events around each call, graph = CUDA-graph replay (GPU only);")
    print("GB/s = fewest bytes / graph time; cpu = host us per call")
    print(" " * 30 + f"{'eager':-^50}{'CUDA graph':-^50}{'GB/s':-^16}{'cpu us':-^26}")
    header = f"{'kernel':<24}{'dtype':<6}" + f"{'fwd':>9}{'ref':>9}{'x':>7}{'f+b':>9}{'ref':>9}{'x':>7}" * 2
    header += f"{'fwd':>9}{'f+b':>7}{'fwd':>8}{'ref':>6}{'f+b':>6}{'ref':>6}"
    if with_compile:
        header += f"{'compiled fwd':>13}{'f+b':>8}"
    print(header)
    for name, dtype_name, _, times, forward_bytes, total_bytes in rows:
        line = f"{name:<24}{dtype_name:<6}" + _speed_columns(times, "eager") + _speed_columns(times, "graph")
        line += f"{forward_bytes / times[('fast', 'graph', False)] / 1e6:>9.0f}{total_bytes / times[('fast', 'graph', True)] / 1e6:>7.0f}"
        cpu = [times[(who, "cpu", backward)] for backward in (False, True) for who in ("fast", "ref")]
        line += f"{cpu[0]:>8.0f}{cpu[1]:>6.0f}{cpu[2]:>6.0f}{cpu[3]:>6.0f}"
        if with_compile:
            line += f"{times[('compiled', 'eager', False)]:>13.3f}{times[('compiled', 'eager', True)]:>8.3f}"
        print(line)


def _sweep_one(label, launch, configs):
    from triton.testing import do_bench

    results = []
    for config in configs:
        try:
            results.append((do_bench(lambda: launch(config), warmup=10, rep=50, return_mode="median"), config))
        except Exception as error:  # a configuration the compiler rejects (too many registers) is skipped
            print(f"  {label} {config}: failed ({type(error).__name__})")
    first = f" (first listed {results[0][1]}: {results[0][0]:.3f}ms)" if results else ""
    results.sort(key=lambda r: r[0])
    print(f"{label}{first}: " + ", ".join(f"{config} {ms:.3f}ms" for ms, config in results[:6]), flush=True)


def _sweep_softmax(dtype):
    """The causal softmax's launch configurations (its [b, n, s, s] tensors are freed on return)."""
    from megatron.core.fused_kernels import triton_softmax as ts

    scores = torch.randn(SOFTMAX_BATCH, HEADS, SEQ, SEQ, device="cuda").to(dtype)
    probs = ts.softmax_forward(scores, None, 0.1, True)
    softmax_configs = [(m, w) for m in (1, 2) for w in (2, 4, 8)]
    _sweep_one("softmax fwd causal", lambda c: ts.softmax_forward(scores, None, 0.1, True, *c), softmax_configs)
    _sweep_one("softmax bwd causal", lambda c: ts.softmax_backward(probs, probs, None, 0.1, True, *c), softmax_configs)


def _sweep_qkv_split(dtype):
    """The query/key/value split's backward (pack dq, dk, dv as attention leaves them, sum the bias
    gradient) against what autograd does without it: a concatenation, then the projection's row sum."""
    from megatron.core.fused_kernels import triton_qkv_split as tq

    head_dim = HIDDEN // HEADS
    # as cuDNN's attention backward leaves them for the trainer's q, k, v: [s, b, np, hn], dense
    grads = [torch.randn(SEQ, MICRO_BATCH, HEADS, head_dim, device="cuda").to(dtype) for _ in range(3)]

    def cat_then_sum():  # autograd's split backward on [s, b, np, hn] views, then the linear's db
        packed = torch.cat(grads, dim=-1)  # [s, b, np, 3 hn]
        return packed, packed.view(-1, 3 * HIDDEN).sum(0)

    configs = [(w, pps, tile) for w in (4, 8) for pps in (4, 8, 16, 32) for tile in (4096, 8192, 16384)]
    _sweep_one("qkv split bwd", lambda c: tq.pack_qkv_grads(*grads, True, *c), configs)
    _sweep_one("qkv cat, then bias row sum", lambda c: cat_then_sum(), [None])


def compare_qkv_split(dtype):
    """Backward of split_query_key_value (dmixed and the bias gradient from dq, dk, dv as cuDNN's
    attention backward leaves them), the Triton kernel against the reference's autograd: multi-head
    attention at the 1.3B GPT's 16 heads of 128 and at 32 heads of 64, then the Llama-style 32 heads
    of 64 over 8 key/value groups and over 1 (multi-query)."""
    print(f"\nqkv split backward, seq {SEQ}, micro-batch {MICRO_BATCH}: ms (median) on the eager clock (host time "
          f"included) and the CUDA-graph clock (GPU time); GB/s = dmixed read + written / graph time")
    for heads, head_dim, queries in ((16, 128, 1), (32, 64, 1), (32, 64, 4), (32, 64, 32)):
        groups = heads // queries
        width = groups * (queries + 2) * head_dim
        mixed = torch.randn(SEQ, MICRO_BATCH, width, device="cuda").to(dtype).requires_grad_(True)
        bias = torch.randn(width, device="cuda").to(dtype).requires_grad_(True)
        grads = [torch.randn(SEQ, MICRO_BATCH, n, head_dim, device="cuda").to(dtype) for n in (heads, groups, groups)]
        eager, graph = [], []
        for split in (fused_kernels.split_query_key_value, reference.split_query_key_value_reference):
            def backward():
                return torch.autograd.grad(split(mixed, bias, head_dim, queries), (mixed, bias), grads)

            eager.append(_time_eager(backward))
            graph.append(_time_graph(backward))
        moved = 2 * mixed.numel() * mixed.element_size()
        print(f"  {heads} heads of {head_dim}, {queries:>2} per group: eager fused {eager[0]:.3f} reference "
              f"{eager[1]:.3f} x{eager[1] / eager[0]:.2f} | graph fused {graph[0]:.3f} reference {graph[1]:.3f} "
              f"x{graph[1] / graph[0]:.2f} | {moved / graph[0] / 1e6:.0f} GB/s", flush=True)


def sweep(dtype):
    """Times of Triton launch configurations at the benchmark shapes (best first)."""
    from megatron.core.fused_kernels import triton_elementwise as te
    from megatron.core.fused_kernels import triton_layer_norm as tln

    _sweep_softmax(dtype)
    _sweep_qkv_split(dtype)
    x = torch.randn(SEQ * MICRO_BATCH, HIDDEN, device="cuda").to(dtype)
    w, b = torch.randn(HIDDEN, device="cuda").to(dtype), torch.randn(HIDDEN, device="cuda").to(dtype)
    _, mean, rstd = tln.layer_norm_forward(x, w, b, EPS)
    _sweep_one("layer_norm fwd", lambda c: tln.layer_norm_forward(x, w, b, EPS, *c), [(m, wp) for m in (1, 2) for wp in (4, 8)])
    ln_backward_configs = [(m, wp, pps) for m in (1, 2) for wp in (4, 8) for pps in (4, 8, 16)]
    _sweep_one("layer_norm bwd", lambda c: tln.layer_norm_backward(x, x, w, mean, rstd, *c), ln_backward_configs)
    _sweep_one("layer_norm bwd + residual grad",
               lambda c: tln.layer_norm_backward(x, x, w, mean, rstd, *c, grad_residual2d=x), ln_backward_configs)
    _sweep_one("layer_norm bwd, then add", lambda c: tln.layer_norm_backward(x, x, w, mean, rstd, *c)[0] + x,
               ln_backward_configs[:1])
    _sweep_one("bias grad (no dropout)", lambda c: te.dropout_backward(x, 0.0, None, *c), _backward_configs())
    _sweep_one("torch sum over rows", lambda c: x.sum(0, dtype=torch.float32), [None])
    y = torch.randn(SEQ * MICRO_BATCH, FFN, device="cuda").to(dtype)
    bias = torch.randn(FFN, device="cuda").to(dtype)
    forward_configs = [((m, n), wp) for m, n in ((1, 1024), (2, 1024), (4, 1024), (8, 512)) for wp in (4, 8)]
    _sweep_one("bias_gelu fwd", lambda c: te.bias_gelu_forward(y, bias, *c), forward_configs[:4])
    _sweep_one("bias_gelu bwd", lambda c: te.bias_gelu_backward(y, y, bias, *c), _backward_configs())
    seed = te.draw_dropout_seed(y.device)
    _sweep_one("dropout fwd", lambda c: te.bias_dropout_add_forward(y, bias, y, DROPOUT, seed, *c), forward_configs)
    _sweep_one("dropout bwd", lambda c: te.dropout_backward(y, DROPOUT, seed, *c), _backward_configs())


def _backward_configs():
    """(tile, warps, programs per SM) of the row-looping elementwise backward kernels; 128 per SM
    gives every tile its own program (no loop). The first is the default."""
    tiles = ((4, 1024), (8, 1024), (8, 512), (16, 512), (32, 256))
    return [(None, 4, None)] + [(tile, wp, pps) for tile in tiles for wp in (4, 8) for pps in (4, 8, 16, 128)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=sorted(DTYPES))
    parser.add_argument("--sweep", action="store_true", help="only time Triton launch configurations (bf16)")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile of the reference")
    parser.add_argument("--cases", nargs="+", default=None, help="only the kernels whose name starts with one of these")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_fused_kernels: needs a CUDA GPU")
    import triton

    # Imported here so that a broken triton stops the benchmark instead of timing the references twice.
    for kernels in ("triton_elementwise", "triton_layer_norm", "triton_rms_norm", "triton_softmax", "triton_qkv_split"):
        importlib.import_module(f"megatron.core.fused_kernels.{kernels}")

    selection.set_fused_kernels_enabled(True)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    if args.sweep:
        sweep(torch.bfloat16)
        return
    cases = [_softmax_case(True), _softmax_case(False), _layer_norm_case(), _rms_norm_case(), _bias_gelu_case(),
             _bias_dropout_add_case()]
    if args.cases:
        cases = [case for case in cases if case.name.startswith(tuple(args.cases))]
    if cases:
        rows = benchmark(cases, args.dtypes, args.compile)
        print_tables(rows, args.compile)
    if not args.cases or "qkv_split".startswith(tuple(args.cases)):
        for dtype_name in args.dtypes:
            compare_qkv_split(DTYPES[dtype_name])


if __name__ == "__main__":
    main()
