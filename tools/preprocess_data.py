"""Preprocess jsonl text into mmap indexed datasets for GPT training.

Each input line is a JSON object; for every ``--json-keys`` key the tool writes
``<output-prefix>_<key>_document.bin/.idx`` (``_sentence`` with ``--split-sentences``), one
document per good line, in input order. Bad lines (malformed JSON, a missing key, non-string or
empty text, invalid UTF-8, a truncated last line) are skipped, counted and listed with file:line
in the final summary; ``--strict`` stops at the first one instead. A run in which no line is usable
(a wrong ``--json-keys``, or a key that no line has) fails naming the keys the input does have, and
writes nothing. Outputs are written under temporary names and renamed when complete; an output
that cannot be written (a read-only or full disk, a file where its directory should be) stops the
run with one line naming the path and the cause, leaving nothing partial.

With ``--workers N > 1`` the parent reads chunks of ``--chunk-size`` lines, N processes encode
them, and the parent writes the results in input order (byte-identical to ``--workers 1``).

A tokenizer that starts sequences with a BOS (Llama's ``<s>``, ``<|begin_of_text|>``) starts every
document with it, so a document is the tokenizer library's own encoding of the text, then the eod
with ``--append-eod``.

Examples:
    python tools/preprocess_data.py --input examples/data/python-docs.jsonl.gz \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --output-prefix runs/data/python-docs --workers 2
    python tools/preprocess_data.py --input corpus.jsonl --append-eod --output-prefix runs/data/corpus \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model llama3/tokenizer.json
"""
import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.data.indexed_dataset import (  # noqa: E402
    IndexedDatasetBuilder,
    IndexedDatasetError,
    data_file_path,
    index_file_path,
    make_output_directory,
)
from megatron.core.data.preprocessing import (  # noqa: E402
    BadLineReport,
    ChunkEncoder,
    EncoderConfig,
    PreprocessingError,
    ProgressReporter,
    TokenizerSpec,
    encode_in_process,
    expand_input_paths,
    no_documents_error,
    init_process_encoder,
    map_in_order,
    output_prefix_for,
    pool_context,
    read_line_chunks,
    set_process_encoder,
    strict_error,
)
from megatron.core.tokenizer import SUPPORTED_TOKENIZER_TYPES, TokenizerError, vocab_size_with_padding  # noqa: E402

CHUNKS_IN_FLIGHT_PER_WORKER = 4
TOOL_ERRORS = (PreprocessingError, TokenizerError, IndexedDatasetError)


def add_preprocessing_arguments(parser):
    """The flags shared by preprocess_data.py and preprocess_data_many_cores.py (Megatron-DeepSpeed's)."""
    group = parser.add_argument_group("input data")
    group.add_argument("--input", nargs="+", required=True,
                       help="jsonl files or globs; plain, .gz or .xz")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys of the text to extract from each JSON object")
    group.add_argument("--split-sentences", action="store_true",
                       help="split documents into sentences with NLTK punkt (one item per sentence)")
    group.add_argument("--keep-newlines", action="store_true",
                       help="with --split-sentences, keep the whitespace (newlines) after each sentence "
                            "(whole documents always keep theirs)")
    group.add_argument("--strict", action="store_true",
                       help="stop with an error at the first bad input line instead of skipping it")

    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", type=str, required=True,
                       help=f"one of {', '.join(SUPPORTED_TOKENIZER_TYPES)}")
    group.add_argument("--vocab-file", type=str, default=None, help="GPT-2 vocab.json")
    group.add_argument("--merge-file", type=str, default=None, help="GPT-2 merges.txt")
    group.add_argument("--tokenizer-name-or-path", type=str, default=None,
                       help="local directory of a HF tokenizer (PretrainedFromHF, HuggingFaceTokenizer)")
    group.add_argument("--tokenizer-model", type=str, default=None,
                       help="a SentencePiece .model (SentencePieceTokenizer) or a tokenizer.json or its "
                            "directory (HuggingFaceTokenizer)")
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document token to every document (a tokenizer's BOS, "
                            "where it has one, always starts each document)")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="pad the reported vocabulary size to a multiple of this")
    group.add_argument("--pad-vocab-size-to", type=int, default=None,
                       help="report the vocabulary padded to exactly this size")

    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", type=str, required=True,
                       help="outputs are <prefix>_<key>_document.bin/.idx")
    group.add_argument("--dataset-impl", type=str, default="mmap", choices=["lazy", "cached", "mmap"],
                       help="only mmap is supported")

    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="number of encoding processes")
    group.add_argument("--chunk-size", type=int, default=256,
                       help="input lines per unit of work handed to a worker")
    group.add_argument("--log-interval", type=int, default=100,
                       help="print progress every this many input documents")
    return parser


def parse_args(argv=None, description=__doc__):
    parser = argparse.ArgumentParser(description=description.split("\n\n")[0])
    return add_preprocessing_arguments(parser).parse_args(argv)


def encoder_config_from_args(args):
    """Validate the flags and turn them into an EncoderConfig."""
    if args.dataset_impl != "mmap":
        raise PreprocessingError(
            f"--dataset-impl {args.dataset_impl} (the legacy TNTIDX format) is not supported; "
            f"use --dataset-impl mmap")
    if args.workers < 1:
        raise PreprocessingError(f"--workers must be at least 1, got {args.workers}")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise PreprocessingError(f"--json-keys has duplicates: {' '.join(args.json_keys)}")
    tokenizer = TokenizerSpec(args.tokenizer_type, args.vocab_file, args.merge_file,
                              args.tokenizer_name_or_path, args.tokenizer_model)
    return EncoderConfig(tokenizer=tokenizer, json_keys=tuple(args.json_keys),
                         split_sentences=args.split_sentences, keep_newlines=args.keep_newlines,
                         append_eod=args.append_eod)


def prepare(args):
    """Validate flags, build the encoder and name the outputs: (encoder, input paths, prefixes)."""
    config = encoder_config_from_args(args)
    paths = expand_input_paths(args.input)
    encoder = ChunkEncoder(config)
    vocab_size = encoder.tokenizer.vocab_size
    padded = vocab_size_with_padding(vocab_size, args.make_vocab_size_divisible_by, 1, args.pad_vocab_size_to)
    print(f"Vocabulary: {vocab_size} tokens, padded to {padded} for the model "
          f"({padded - vocab_size} dummy tokens); tokens stored as {encoder.dtype}.", file=sys.stderr)
    prefixes = [output_prefix_for(args.output_prefix, key, args.split_sentences) for key in config.json_keys]
    make_output_directory(os.path.dirname(os.path.abspath(args.output_prefix)),
                          f"--output-prefix {args.output_prefix}")
    return encoder, paths, prefixes


def encoded_chunks(encoder, paths, args):
    """EncodedChunks of the whole input in order, encoded here or by ``--workers`` processes."""
    chunks = read_line_chunks(paths, args.chunk_size)
    if args.workers == 1:
        for chunk in chunks:
            yield encoder.encode(chunk)
        return
    set_process_encoder(encoder)
    with pool_context().Pool(args.workers, initializer=init_process_encoder, initargs=(encoder.config,)) as pool:
        yield from map_in_order(pool, encode_in_process, chunks, args.workers * CHUNKS_IN_FLIGHT_PER_WORKER)


def account_for_chunk(chunk, report, progress, strict):
    """Record a chunk's bad lines and counts (in input order); raise on a bad line with --strict."""
    report.add(chunk.bad_lines)
    if strict and chunk.bad_lines:
        raise strict_error(chunk.bad_lines[0])
    progress.update(chunk.lines, chunk.nbytes, chunk.documents, chunk.tokens)


@contextlib.contextmanager
def output_builders(prefixes, dtype, paths, json_keys, progress, report):
    """One dataset builder per output prefix; all are finalized when the block completes with
    documents written, and all are aborted (their temporary files removed; an earlier dataset of the
    same prefix stays as it was) if it raises or wrote none, so no output looks complete."""
    builders = []
    try:
        for prefix in prefixes:
            builders.append(IndexedDatasetBuilder(data_file_path(prefix), dtype))
        yield builders
        if progress.documents == 0:
            print("\n".join(report.summary_lines()), file=sys.stderr)
            raise no_documents_error(paths, json_keys)
        for builder, prefix in zip(builders, prefixes):
            builder.finalize(index_file_path(prefix))
    except BaseException:
        for builder in builders:
            builder.abort()
        raise


def print_summary(progress, report, prefixes):
    for line in progress.summary_lines(prefixes) + report.summary_lines():
        print(line, file=sys.stderr)


def preprocess(args):
    """Run the tool; returns (progress, report)."""
    encoder, paths, prefixes = prepare(args)
    keys = encoder.config.json_keys
    report = BadLineReport()
    progress = ProgressReporter(args.log_interval)
    with output_builders(prefixes, encoder.dtype, paths, keys, progress, report) as builders:
        for encoded in encoded_chunks(encoder, paths, args):
            account_for_chunk(encoded, report, progress, args.strict)
            for key, builder in zip(keys, builders):
                documents = encoded.documents_by_key[key]
                builder.add_documents(documents.tokens, documents.sizes, documents.doc_item_counts)
    print_summary(progress, report, prefixes)
    return progress, report


def run_tool(preprocess_function, argv=None, description=__doc__):
    """Parse flags, run, and turn known errors into a one-line message and exit status 1."""
    args = parse_args(argv, description)
    try:
        preprocess_function(args)
    except TOOL_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(preprocess))
