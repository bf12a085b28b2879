"""Time to build the GPT dataset indices (doc/sample/shuffle) of a synthetic large dataset.

A fake indexed dataset holds only a ``sizes`` array: `--documents` documents of random
(exponentially distributed) lengths summing exactly to `--tokens`. The benchmark asks for one
epoch of samples at `--seq-length` and reports:

- build: ``build_index_arrays`` alone (no fingerprint, no files);
- cold: a GPTDataset constructed on an empty cache directory (fingerprint, build, writing the
  three .npy files, memory-mapping them), the figure a training start pays once;
- warm: the same construction when the cache exists (fingerprint + memory-mapping).

    python3 tools/benchmarks/bench_index_build.py [--tokens 1e9] [--documents 2000000]
        [--seq-length 2048] [--seed 1234] [--cache-dir DIR]

Target: cold under 10 s for 1e9 tokens at seq 2048 on a 2-core machine.
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.core.data import gpt_dataset  # noqa: E402
from megatron.core.data.helpers import load_helpers  # noqa: E402


class SizesOnlyDataset:
    """Stands in for an indexed dataset when only the index construction is measured."""

    def __init__(self, sizes):
        self.sizes = sizes

    def __len__(self):
        return len(self.sizes)


def synthetic_sizes(num_tokens, num_documents, seed):
    """int32 document lengths >= 1, exponentially distributed, summing exactly to num_tokens."""
    rng = np.random.default_rng(seed)
    raw = rng.exponential(1.0, num_documents)
    sizes = 1 + np.floor(raw / raw.sum() * (num_tokens - num_documents)).astype(np.int64)
    shortfall = num_tokens - int(sizes.sum())
    sizes[:shortfall] += 1  # floor lost fewer than num_documents tokens
    return sizes.astype(np.int32)


def timed(function, *args):
    start = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=float, default=1e9)
    parser.add_argument("--documents", type=int, default=2_000_000)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--cache-dir", default=None, help="default: a temporary directory")
    args = parser.parse_args()

    _, compile_s = timed(load_helpers)
    sizes = synthetic_sizes(int(args.tokens), args.documents, args.seed)
    documents = np.arange(args.documents, dtype=np.int64)
    num_samples = (int(sizes.sum(dtype=np.int64)) - 1) // args.seq_length  # one epoch
    print(f"dataset: {args.documents:,} documents, {int(sizes.sum(dtype=np.int64)):,} tokens, "
          f"seq {args.seq_length}, {num_samples:,} samples (one epoch); helpers ready in "
          f"{compile_s:.2f} s")

    _, build_s = timed(gpt_dataset.build_index_arrays, sizes, documents, num_samples,
                       args.seq_length, args.seed)
    _, fingerprint_s = timed(gpt_dataset.dataset_fingerprint, sizes, documents)
    with tempfile.TemporaryDirectory() as scratch:
        cache_dir = args.cache_dir or scratch
        construct = lambda: gpt_dataset.GPTDataset(  # noqa: E731
            "train", os.path.join(cache_dir, "synthetic"), SizesOnlyDataset(sizes), documents,
            num_samples, args.seq_length, args.seed, cache_dir=cache_dir)
        cold, cold_s = timed(construct)
        warm, warm_s = timed(construct)
        assert len(cold) == len(warm) >= num_samples
        cache_mb = sum(os.path.getsize(p) for p in cold.cache_paths.values()) / 1e6

    print(f"build_index_arrays : {build_s:7.3f} s")
    print(f"fingerprint        : {fingerprint_s:7.3f} s")
    print(f"cold (build+save)  : {cold_s:7.3f} s   ({cache_mb:.0f} MB of .npy)")
    print(f"warm (cached load) : {warm_s:7.3f} s")
    print(f"target < 10 s      : {'met' if cold_s < 10 else 'MISSED'}")


if __name__ == "__main__":
    main()
