"""Train a GPT-2-style byte-level BPE on jsonl text and write GPT-2-format vocab.json + merges.txt.

The merges are learned with HF ``tokenizers`` (GPT-2 pre-tokenization, no prefix space). The
vocabulary is then written in GPT-2's layout, so that a token's id equals its BPE rank (what the
tiktoken fast path needs to run without an id remapping):

    ids 0..255          the 256 byte tokens, in GPT-2's byte order (``bytes_to_unicode``)
    ids 256..256+M-1    one token per merge, in merge order (id = 256 + merge index)
    id  256+M           <|endoftext|>, the last id (like GPT-2's 50256)

so ``--vocab-size V`` asks for M = V - 257 merges. A corpus with fewer distinct pairs stops earlier;
the tool then says how many it found. Output is deterministic for the same input and flags.

Example:
    python tools/train_tokenizer.py --input examples/data/python-docs.jsonl.gz \
        --vocab-size 50257 --output-dir runs/tokenizer
"""
import argparse
import io
import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.data.preprocessing import PreprocessingError, expand_input_paths, open_jsonl  # noqa: E402
from megatron.core.tokenizer.gpt2_bpe import EOD_TOKEN, bytes_to_unicode  # noqa: E402

MIN_VOCAB_SIZE = 257  # the 256 bytes and <|endoftext|>
MERGES_VERSION_LINE = "#version: 0.2"


class TrainTokenizerError(ValueError):
    """Bad flags or input for train_tokenizer."""


def expand_inputs(patterns):
    """The files named by --input (paths or globs), as the preprocessing tools read them."""
    try:
        return expand_input_paths(patterns)
    except PreprocessingError as err:
        raise TrainTokenizerError(str(err)) from None


def open_text(path):
    """Open a plain, .gz or .xz file as UTF-8 text (undecodable bytes become U+FFFD)."""
    return io.TextIOWrapper(open_jsonl(path), encoding="utf-8", errors="replace")


def iter_texts(paths, json_keys, counts):
    """Yield the string under each of ``json_keys`` of every jsonl line; count what is skipped.

    ``counts`` receives ``documents``, ``bytes`` and ``skipped`` (lines that are not JSON objects,
    or keys that are missing or not strings); the first few skipped file:line go to ``first_bad``.
    """
    for path in paths:
        with open_text(path) as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    record = None
                for key in json_keys:
                    text = record.get(key) if isinstance(record, dict) else None
                    if not isinstance(text, str):
                        counts["skipped"] += 1
                        if len(counts["first_bad"]) < 5:
                            counts["first_bad"].append(f"{path}:{line_number} ({key})")
                        continue
                    counts["documents"] += 1
                    counts["bytes"] += len(text.encode("utf-8"))
                    yield text


def learn_merges(texts, vocab_size):
    """Merges (left, right) in learned order, from HF ``tokenizers``' BPE trainer.

    Trained with the 256 byte characters as initial alphabet and <|endoftext|> as special token,
    so it stops after ``vocab_size - 257`` new tokens (or when no pair is left).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" "))
            for merge in merges]


def gpt2_layout_vocab(merges):
    """vocab.json contents: bytes in GPT-2 order, then merge results in merge order, then eod.

    A merge whose result already exists (HF's trainer can learn two pairs with the same result)
    keeps the first token's id; such files remain valid but use the HF fast path, not tiktoken.
    """
    vocab = {}
    for char in bytes_to_unicode().values():
        vocab[char] = len(vocab)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    vocab[EOD_TOKEN] = len(vocab)
    return vocab


def write_tokenizer_files(output_dir, vocab, merges):
    """Write vocab.json and merges.txt under temporary names, then rename both into place. An OSError
    (read-only, full, a file in the way) raises TrainTokenizerError naming the path and the cause;
    the temporary files are removed."""
    try:
        return _write_tokenizer_files(output_dir, vocab, merges)
    except OSError as error:
        where = error.filename if error.filename is not None else output_dir
        raise TrainTokenizerError(f"--output-dir {output_dir}: cannot write {where}: "
                                  f"{error.strerror or error}") from None


def _write_tokenizer_files(output_dir, vocab, merges):
    os.makedirs(output_dir, exist_ok=True)
    merge_lines = [MERGES_VERSION_LINE] + [f"{left} {right}" for left, right in merges]
    contents = {
        os.path.join(output_dir, "vocab.json"): json.dumps(vocab, ensure_ascii=False),
        os.path.join(output_dir, "merges.txt"): "\n".join(merge_lines) + "\n",
    }
    temporaries = {path: f"{path}.tmp-{os.getpid()}" for path in contents}
    try:
        for path, text in contents.items():
            with open(temporaries[path], "w", encoding="utf-8") as handle:
                handle.write(text)
        for path, temporary in temporaries.items():
            os.replace(temporary, path)
    finally:
        for temporary in temporaries.values():
            try:
                os.remove(temporary)
            except FileNotFoundError:
                pass
    return tuple(contents)


def train_tokenizer(inputs, output_dir, vocab_size=50257, json_keys=("text",)):
    """Train on the jsonl files ``inputs`` and write the tokenizer; returns a summary dict."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise TrainTokenizerError(f"--vocab-size {vocab_size}: must be at least {MIN_VOCAB_SIZE} "
                                  "(256 bytes and <|endoftext|>)")
    paths = expand_inputs(inputs)
    counts = {"documents": 0, "bytes": 0, "skipped": 0, "first_bad": []}
    merges = learn_merges(iter_texts(paths, list(json_keys), counts), vocab_size)
    if counts["documents"] == 0:
        raise TrainTokenizerError(f"--input {' '.join(inputs)}: no document with keys "
                                  f"{list(json_keys)} (see --json-keys)")
    vocab = gpt2_layout_vocab(merges)
    vocab_file, merge_file = write_tokenizer_files(output_dir, vocab, merges)
    return {"vocab_file": vocab_file, "merge_file": merge_file, "vocab_size": len(vocab),
            "merges": len(merges), "eod": vocab[EOD_TOKEN], **counts}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help="jsonl files (plain, .gz or .xz); several files or globs")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="keys of the jsonl records to train on (default: text)")
    parser.add_argument("--vocab-size", type=int, default=50257,
                        help="vocabulary size including the 256 bytes and <|endoftext|>")
    parser.add_argument("--output-dir", required=True, help="where vocab.json and merges.txt go")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        summary = train_tokenizer(args.input, args.output_dir, args.vocab_size, args.json_keys)
    except TrainTokenizerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"trained on {summary['documents']} documents ({summary['bytes'] / 1e6:.2f} MB); "
          f"skipped {summary['skipped']} bad records"
          + (f", first at {', '.join(summary['first_bad'])}" if summary["first_bad"] else ""))
    if summary["vocab_size"] < args.vocab_size:
        print(f"note: the input only supports {summary['merges']} merges, so the vocabulary has "
              f"{summary['vocab_size']} tokens instead of {args.vocab_size}")
    print(f"wrote {summary['vocab_file']} ({summary['vocab_size']} tokens, "
          f"<|endoftext|> = {summary['eod']})")
    print(f"wrote {summary['merge_file']} ({summary['merges']} merges)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
