"""Benchmark preprocessing throughput in MB/s of jsonl per worker.

Builds a larger jsonl by repeating the sample corpus, trains (or reuses) a byte-level BPE with
``tools/train_tokenizer.py --vocab-size 50257``, then runs ``preprocess_data.py`` and
``preprocess_data_many_cores.py`` with each ``--workers`` count and prints a table. For scale it
also measures the tokenizer alone (``tokenize_batch`` on one thread), the ceiling of one worker.

    python tools/benchmarks/bench_preprocess.py --target-mb 40 --workers 1 2
    python tools/benchmarks/bench_preprocess.py --tokenizer gpt2 hf --workers 1

``--tokenizer hf`` runs the same BPE as a Llama 3 style tokenizer.json (``--tokenizer-type
HuggingFaceTokenizer``: the vocab/merges as a ``tokenizers`` byte-level BPE, with
``<|begin_of_text|>`` put before each document and ``<|end_of_text|>`` as eod), so the two rows
differ only by the encoding library; the script checks that both give the same text ids. The HF
``tokenizers`` library encodes a batch on several threads unless TOKENIZERS_PARALLELISM=false.

``MB/s`` is jsonl bytes over the tool's own processing time (from its ``Done:`` line: reading,
parsing, tokenizing and writing, after the tokenizer is loaded); ``wall s`` adds the start-up.
``MB/cpu-s`` divides by the CPU time of the tool and its workers (user + sys) less that of a run
on a one-line input (start-up), i.e. the rate per fully used core; it is the figure to trust on
a machine shared with other jobs, where wall-clock rates drop with the load. All runs must
produce byte-identical outputs, which the script checks.
"""
import argparse
import filecmp
import gzip
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir, os.path.pardir))
sys.path.insert(0, REPO_ROOT)

from megatron.core.tokenizer import build_tokenizer  # noqa: E402
from megatron.core.tokenizer.bpe_files import read_merge_file  # noqa: E402
from tools.train_tokenizer import train_tokenizer  # noqa: E402

SAMPLE_CORPUS = os.path.join(REPO_ROOT, "examples", "data", "python-docs.jsonl.gz")
TOOLS = {
    "preprocess_data": os.path.join(REPO_ROOT, "tools", "preprocess_data.py"),
    "many_cores": os.path.join(REPO_ROOT, "tools", "preprocess_data_many_cores.py"),
}
DONE_LINE = re.compile(r"Done: read (\d+) lines \(([\d.]+) MB\) in ([\d.]+) s")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default=SAMPLE_CORPUS, help="jsonl(.gz) to repeat")
    parser.add_argument("--target-mb", type=float, default=40.0, help="size of the repeated jsonl")
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--vocab-file", help="reuse this vocab.json instead of training one")
    parser.add_argument("--merge-file", help="reuse this merges.txt instead of training one")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--tools", nargs="+", choices=sorted(TOOLS), default=sorted(TOOLS))
    parser.add_argument("--tokenizer", nargs="+", choices=("gpt2", "hf"), default=["gpt2"],
                        help="gpt2: GPT2BPETokenizer on vocab/merges; hf: the same BPE as a Llama 3 style "
                             "tokenizer.json (HuggingFaceTokenizer)")
    parser.add_argument("--workdir", help="where to write the data (default: a temporary directory)")
    return parser.parse_args()


def build_large_jsonl(corpus, target_mb, path):
    """Repeat ``corpus`` until ``path`` holds at least ``target_mb`` MB; returns its size in bytes."""
    opener = gzip.open if corpus.endswith(".gz") else open
    with opener(corpus, "rb") as source:
        data = source.read()
    if not data.endswith(b"\n"):
        data += b"\n"
    repeats = max(1, int(-(-target_mb * 1e6 // len(data))))
    with open(path, "wb") as out:
        for _ in range(repeats):
            out.write(data)
    return os.path.getsize(path)


def write_llama3_style_tokenizer(vocab_file, merge_file, directory):
    """The BPE of ``vocab_file``/``merge_file`` as a Llama 3 style tokenizer.json in ``directory``:
    byte-level, ``<|begin_of_text|>`` (BOS, put before every sequence) and ``<|end_of_text|>`` added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    with open(vocab_file, encoding="utf-8") as handle:
        vocab = json.load(handle)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=read_merge_file(merge_file)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    bos = "<|begin_of_text|>"
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                             special_tokens=[(bos, tokenizer.token_to_id(bos))])
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    return os.path.join(directory, "tokenizer.json")


def tokenizer_flags(name, files):
    """The preprocessing flags of tokenizer ``name`` (gpt2, hf) on ``files`` (vocab, merges, tokenizer.json)."""
    vocab_file, merge_file, tokenizer_json = files
    if name == "hf":
        return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_json]
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file, "--merge-file", merge_file]


def build_named_tokenizer(name, files):
    vocab_file, merge_file, tokenizer_json = files
    if name == "hf":
        return build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tokenizer_json)
    return build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)


def tokenizer_only_rates(tokenizer, texts):
    """MB/s of ``tokenize_batch`` alone over ``texts`` (UTF-8 bytes), batches of 256: (wall, CPU), best of 3."""
    nbytes = sum(len(text.encode("utf-8")) for text in texts)
    best_wall = best_cpu = float("inf")
    for _ in range(3):
        wall, cpu = time.perf_counter(), time.process_time()
        for first in range(0, len(texts), 256):
            tokenizer.tokenize_batch(texts[first:first + 256])
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    return nbytes / best_wall / 1e6, nbytes / best_cpu / 1e6


def run_tool(tool, jsonl, prefix, flags, workers, chunk_size):
    """Run one tool with tokenizer ``flags``; returns (processing seconds, MB, wall seconds, CPU seconds)."""
    command = [sys.executable, TOOLS[tool], "--input", jsonl, "--output-prefix", prefix, *flags,
               "--append-eod", "--workers", str(workers), "--chunk-size", str(chunk_size),
               "--log-interval", "1000000000"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{tool} failed:\n{result.stderr}")
    match = DONE_LINE.search(result.stderr)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return float(match.group(3)), float(match.group(2)), wall, cpu


def main():
    args = parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_preprocess.")
    os.makedirs(workdir, exist_ok=True)
    jsonl = os.path.join(workdir, "repeated.jsonl")
    size = build_large_jsonl(args.corpus, args.target_mb, jsonl)
    print(f"input: {jsonl} ({size / 1e6:.1f} MB)")
    vocab_file, merge_file = args.vocab_file, args.merge_file
    if not (vocab_file and merge_file):
        summary = train_tokenizer([args.corpus], os.path.join(workdir, "tokenizer"), vocab_size=args.vocab_size)
        vocab_file, merge_file = summary["vocab_file"], summary["merge_file"]
    files = (vocab_file, merge_file, write_llama3_style_tokenizer(vocab_file, merge_file,
                                                                  os.path.join(workdir, "llama3_style")))
    report_tokenizers_alone(args, files)
    one_line = os.path.join(workdir, "one_line.jsonl")
    with open(jsonl, "rb") as source, open(one_line, "wb") as out:
        out.write(source.readline())
    print(f"{'tokenizer':<10}{'tool':<16}{'workers':>8}{'MB':>8}{'seconds':>9}{'wall s':>8}{'MB/s':>8}"
          f"{'MB/s/worker':>13}{'MB/cpu-s':>10}")
    for name in args.tokenizer:
        reference = None
        for tool in args.tools:
            for workers in args.workers:
                prefix = os.path.join(workdir, f"{name}_{tool}_w{workers}")
                output = run_and_report(name, tool, workers, (jsonl, one_line, prefix), files, args.chunk_size)
                reference = reference or output
                check_identical(reference, output)
    print(f"outputs of each tokenizer byte-identical across tools and workers; files in {workdir}")


def report_tokenizers_alone(args, files):
    """Print each tokenizer's ``tokenize_batch`` rate on the corpus; check that they give the same ids."""
    opener = gzip.open if args.corpus.endswith(".gz") else open
    with opener(args.corpus, "rt", encoding="utf-8") as source:
        texts = [json.loads(line)["text"] for line in source]
    ids = {}
    for name in args.tokenizer:
        tokenizer = build_named_tokenizer(name, files)
        wall_rate, cpu_rate = tokenizer_only_rates(tokenizer, texts)
        ids[name] = tokenizer.tokenize_batch(texts)
        print(f"tokenizer {name}: vocab {tokenizer.vocab_size}, bos {tokenizer.bos}, eod {tokenizer.eod} "
              f"({tokenizer.fast_path_reason}); tokenize_batch alone: {wall_rate:.2f} MB/s of text, "
              f"{cpu_rate:.2f} MB per CPU second")
    if len(set(map(str, ids.values()))) > 1:
        raise SystemExit("the tokenizers give different text ids on the corpus")


def run_and_report(name, tool, workers, paths, files, chunk_size):
    """Run ``tool`` (after a one-line run that measures the start-up) and print its row; returns the output prefix."""
    jsonl, one_line, prefix = paths
    flags = tokenizer_flags(name, files)
    startup_cpu = run_tool(tool, one_line, prefix + "_startup", flags, workers, chunk_size)[3]
    seconds, megabytes, wall, cpu = run_tool(tool, jsonl, prefix, flags, workers, chunk_size)
    print(f"{name:<10}{tool:<16}{workers:>8}{megabytes:>8.1f}{seconds:>9.2f}{wall:>8.2f}{megabytes / seconds:>8.2f}"
          f"{megabytes / seconds / workers:>13.2f}{megabytes / max(cpu - startup_cpu, 1e-9):>10.2f}", flush=True)
    return prefix + "_text_document"


def check_identical(reference, output):
    for ext in (".bin", ".idx"):
        if not filecmp.cmp(reference + ext, output + ext, shallow=False):
            raise SystemExit(f"{output}{ext} differs from {reference}{ext}")


if __name__ == "__main__":
    main()
