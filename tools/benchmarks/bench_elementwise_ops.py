"""The Triton SwiGLU and rotary embedding against their torch references on one GPU, at the shapes of
the Llama-style 1.2B (seq 4096, micro-batch 4, ffn 8192, 32 query heads over 8 key/value groups of 64).

- swiglu: x [4096 * 4, 2 * 8192] -> a * silu(g) [4096 * 4, 8192];
- rotary: query [4096, 4, 32, 64] (the grouped split's copy) and key [4096, 4, 8, 64] (a strided view
  of the query_key_value output) -> [b, heads, s, hn], positions of documents restarting at random
  points, all 64 channels rotated; the incoming gradients contiguous [b, heads, s, hn].

For each: the forward, and forward + backward (``torch.autograd.grad``, so no gradient accumulation is
timed), in ms (median of CUDA-event timings), of the Triton path (its autograd Function called
directly), the reference in eager torch (the model's current math) and, with ``--compile``, the
reference under torch.compile (what the peer runs); the speed-up over eager; and the Triton path's
bandwidth over the fewest bytes the op moves (each input read once, each output written once).
Before timing, the max |triton - reference| / max |reference| of each output and gradient.

    python3 tools/benchmarks/bench_elementwise_ops.py [--seq 4096] [--batch 4] [--repeats 20] [--compile] [--sweep]

``--sweep`` also times the kernels' launch settings (rotary: tokens per program, head shares, warps;
swiglu: tile elements, widest tile, warps), forward + backward.
"""
import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from megatron.core.fused_kernels import elementwise_ops  # noqa: E402
from megatron.core.models.gpt.positional import rotary_inverse_frequencies  # noqa: E402
from tools.benchmarks.cuda_timing import median_ms, refuse_non_positive  # noqa: E402

FFN, HEADS, GROUPS, HEAD_DIM = 8192, 32, 8, 64
DTYPE = torch.bfloat16
DEVICE = "cuda"


def _swiglu_setup(args):
    """(inputs, grads, reference, triton, bytes forward, bytes forward + backward)."""
    from megatron.core.fused_kernels import triton_swiglu

    tokens = args.seq * args.batch
    x = torch.randn(tokens, 2 * FFN, device=DEVICE, dtype=DTYPE, requires_grad=True)
    grad = torch.randn(tokens, FFN, device=DEVICE, dtype=DTYPE)
    element = x.element_size()
    forward_bytes = 3 * tokens * FFN * element
    return ([x], [grad], lambda t: (elementwise_ops.swiglu_reference(t),),
            lambda t: (triton_swiglu.SwiGLUFunction.apply(t),), forward_bytes, forward_bytes + 5 * tokens * FFN * element)


def _positions(batch, seq):
    """Positions [b, s] of documents restarting with chance 1/1000 per token."""
    index = torch.arange(seq, device=DEVICE).expand(batch, seq)
    starts = torch.rand(batch, seq, device=DEVICE) < 1e-3
    return index - torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values


def _rotary_setup(args):
    """(inputs, grads, reference, triton, bytes forward, bytes forward + backward)."""
    from megatron.core.fused_kernels import triton_rotary

    queries = HEADS // GROUPS
    mixed = torch.randn(args.seq, args.batch, GROUPS, queries + 2, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    query = mixed[:, :, :, :queries].reshape(args.seq, args.batch, HEADS, HEAD_DIM).requires_grad_(True)
    key = mixed[:, :, :, queries].requires_grad_(True)  # [s, b, g, hn] view, token stride g * (q + 2) * hn
    positions, inv_freq = _positions(args.batch, args.seq), rotary_inverse_frequencies(HEAD_DIM, device=DEVICE)
    grads = [torch.randn(args.batch, n, args.seq, HEAD_DIM, device=DEVICE, dtype=DTYPE) for n in (HEADS, GROUPS)]
    moved = 2 * (HEADS + GROUPS) * args.seq * args.batch * HEAD_DIM * query.element_size()
    return ([query, key], grads,
            lambda q, k: elementwise_ops.rotary_embedding_reference(q, k, positions, inv_freq, True),
            lambda q, k: triton_rotary.RotaryEmbeddingFunction.apply(q, k, positions, inv_freq, True),
            moved, 2 * moved)


def _timings(inputs, grads, fn, repeats):
    """(forward ms, forward + backward ms) of ``fn(*inputs)``."""
    def forward():
        with torch.no_grad():
            fn(*inputs)

    def forward_backward():
        torch.autograd.grad(fn(*inputs), inputs, grads)

    return median_ms(forward, repeats, warmup=2), median_ms(forward_backward, repeats, warmup=2)


def _relative_errors(inputs, grads, reference, triton):
    """max |triton - reference| / max |reference| of each output, then of each input gradient."""
    errors = []
    results = []
    for fn in (reference, triton):
        outputs = fn(*inputs)
        results.append([t.detach() for t in outputs] + list(torch.autograd.grad(outputs, inputs, grads)))
    for ref, fast in zip(*results):
        errors.append(((fast.float() - ref.float()).abs().max() / ref.float().abs().max()).item())
    return errors


def _report(name, setup, args):
    inputs, grads, reference, triton, forward_bytes, total_bytes = setup(args)
    errors = ", ".join(f"{e:.2e}" for e in _relative_errors(inputs, grads, reference, triton))
    print(f"{name}: relative max errors (outputs, then gradients): {errors}")
    contenders = [("triton", triton), ("torch eager", reference)]
    if args.compile:
        contenders.append(("torch.compile", torch.compile(reference)))
    rows = {label: _timings(inputs, grads, fn, args.repeats) for label, fn in contenders}
    eager = rows["torch eager"]
    print(f"{'':16}{'fwd ms':>9}{'fwd+bwd ms':>12}{'fwd x':>8}{'fwd+bwd x':>11}{'fwd GB/s':>10}{'fwd+bwd GB/s':>14}")
    for label, (forward, both) in rows.items():
        bandwidth = "" if label != "triton" else f"{forward_bytes / forward / 1e6:10.0f}{total_bytes / both / 1e6:14.0f}"
        print(f"{label:16}{forward:9.3f}{both:12.3f}{eager[0] / forward:8.2f}{eager[1] / both:11.2f}{bandwidth}")


def _sweep(args):
    from megatron.core.fused_kernels import triton_rotary, triton_swiglu

    (query, key), (grad_q, grad_k), *_ = _rotary_setup(args)
    positions, inv_freq = _positions(args.batch, args.seq), rotary_inverse_frequencies(HEAD_DIM, device=DEVICE)
    print("rotary forward + backward ms by (tokens per program, head shares, warps):")
    for block_s, splits, warps in itertools.product((8, 16, 32, 64), (1, 2, 4, 8), (2, 4, 8)):
        settings = dict(block_s=block_s, head_splits=splits, num_warps=warps)

        def both():
            triton_rotary.rotate(query, key, positions, inv_freq, inverse=False, in_batch_first=False,
                                 out_batch_first=True, **settings)
            triton_rotary.rotate(grad_q, grad_k, positions, inv_freq, inverse=True, in_batch_first=True,
                                 out_batch_first=False, **settings)

        print(f"  {block_s:3} {splits} {warps}: {median_ms(both, args.repeats, warmup=2):.3f}")
    (x,), (grad,), *_ = _swiglu_setup(args)
    x2d = x.detach()
    print("swiglu forward + backward ms by (tile elements, widest tile, warps):")
    for elements, columns, warps in itertools.product((2048, 4096, 8192), (512, 1024, 2048), (4, 8)):
        tile = triton_swiglu.tile_for(FFN, elements, columns)

        def both():
            triton_swiglu.swiglu_forward(x2d, tile, warps)
            triton_swiglu.swiglu_backward(grad, x2d, tile, warps)

        print(f"  {elements:5} {columns:5} {warps}: {median_ms(both, args.repeats, warmup=2):.3f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="also time the references under torch.compile")
    parser.add_argument("--sweep", action="store_true", help="also time the kernels' launch settings")
    args = parser.parse_args(argv)
    refuse_non_positive(parser, args, "seq", "batch", "repeats")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (and triton)")
    torch.manual_seed(0)
    _report("swiglu", _swiglu_setup, args)
    _report("rotary", _rotary_setup, args)
    if args.sweep:
        _sweep(args)


if __name__ == "__main__":
    main()
