"""Single-thread tokenization throughput (MB/s of UTF-8 text) of the GPT-2 BPE paths.

Trains a byte-level BPE with ``tools/train_tokenizer.py`` (--vocab-size 50257 by default) on the
sample corpus, then times, on one thread:
  reference   the regex reference (fresh tokenizer, so its piece cache starts cold)
  fast        the default fast path (tiktoken), ``tokenize_batch``
  hf          HF ``tokenizers`` BPE on the same files (the fallback fast path), for comparison
in two settings: "seen" (timed on the training corpus itself) and "held-out" (trained on the even
documents, timed on the odd ones, so words are split into several tokens more often).

    python tools/benchmarks/bench_tokenizer.py [--input FILE.jsonl.gz] [--repeats 3]
"""
import argparse
import gzip
import json
import os
import sys
import tempfile
import time

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir, os.path.pardir))
sys.path.insert(0, REPO_ROOT)

from megatron.core.tokenizer import GPT2BPETokenizer  # noqa: E402
from megatron.core.tokenizer.fast_bpe import HFTokenizersBPE  # noqa: E402
from megatron.core.tokenizer.gpt2_bpe import read_merge_file, read_vocab_file  # noqa: E402
from tools.train_tokenizer import train_tokenizer  # noqa: E402

SAMPLE_CORPUS = os.path.join(REPO_ROOT, "examples", "data", "python-docs.jsonl.gz")


def read_texts(path):
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line)["text"] for line in handle]


def best_seconds(function, repeats):
    """Least CPU time of this process over ``repeats`` calls.

    Everything timed runs on one thread, so CPU time equals wall time on an idle machine and is
    less disturbed by other processes on a shared one.
    """
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        function()
        best = min(best, time.process_time() - start)
    return best


def bench_setting(name, train_texts_file, texts, vocab_size, repeats, workdir):
    summary = train_tokenizer([train_texts_file], os.path.join(workdir, name), vocab_size)
    files = (summary["vocab_file"], summary["merge_file"])
    megabytes = sum(len(text.encode("utf-8")) for text in texts) / 1e6
    start = time.process_time()
    fast = GPT2BPETokenizer(*files)
    build_seconds = time.process_time() - start
    tokens = sum(len(ids) for ids in fast.tokenize_batch(texts))
    hf = HFTokenizersBPE(read_vocab_file(files[0]), read_merge_file(files[1]))
    rows = {
        "reference": best_seconds(
            lambda: GPT2BPETokenizer(*files, use_fast=False).tokenize_batch(texts), 1),
        "fast": best_seconds(lambda: fast.tokenize_batch(texts), repeats),
        "hf": best_seconds(lambda: [hf.encode(text) for text in texts], repeats),
    }
    print(f"{name}: vocab {summary['vocab_size']} tokens, {megabytes:.2f} MB of text, "
          f"{tokens} tokens ({tokens / megabytes / 1e6:.3f} per byte); fast path "
          f"'{fast.fast_path_reason}' built in {build_seconds:.2f} s")
    for path, seconds in rows.items():
        print(f"  {path:<10} {megabytes / seconds:7.2f} MB/s  "
              f"{tokens / seconds / 1e6:6.2f} M tok/s")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", default=SAMPLE_CORPUS, help="jsonl.gz with a 'text' key")
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    texts = read_texts(args.input)
    with tempfile.TemporaryDirectory() as workdir:
        bench_setting("seen", args.input, texts, args.vocab_size, args.repeats, workdir)
        even = os.path.join(workdir, "even.jsonl.gz")
        with gzip.open(even, "wt", encoding="utf-8") as handle:
            handle.writelines(json.dumps({"text": text}) + "\n" for text in texts[::2])
        bench_setting("held-out", even, texts[1::2], args.vocab_size, args.repeats, workdir)


if __name__ == "__main__":
    main()
