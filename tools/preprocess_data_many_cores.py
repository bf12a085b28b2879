"""Preprocess jsonl into mmap indexed datasets with many processes (same flags as preprocess_data.py).

The parent reads chunks of ``--chunk-size`` lines and hands them to ``--workers`` processes; each
worker encodes its chunk and writes it as a small partial dataset in a temporary directory next
to the output. The parent appends the partial datasets to the outputs in input order as they
complete (deleting each once appended), so the output is byte-identical to preprocess_data.py on
the same input and tokenizer, the parent does no tokenization, and memory and scratch disk stay
bounded by the chunks in flight.

Example:
    python tools/preprocess_data_many_cores.py --input 'corpus/*.jsonl.xz' \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \
        --append-eod --output-prefix data/corpus --workers 16
"""
import dataclasses
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from preprocess_data import (  # noqa: E402
    CHUNKS_IN_FLIGHT_PER_WORKER,
    account_for_chunk,
    output_builders,
    prepare,
    print_summary,
    run_tool,
)

from megatron.core.data.indexed_dataset import (  # noqa: E402
    IndexedDatasetBuilder,
    IndexedDatasetError,
    data_file_path,
    index_file_path,
)
from megatron.core.data.preprocessing import (  # noqa: E402
    BadLineReport,
    ProgressReporter,
    encode_in_process,
    init_process_encoder,
    map_in_order,
    pool_context,
    read_line_chunks,
    set_process_encoder,
)


@dataclasses.dataclass
class PartSummary:
    """What a worker reports about the partial datasets it wrote for one chunk."""

    index: int
    lines: int
    nbytes: int
    documents: int
    tokens: int
    bad_lines: list


def part_prefix(parts_dir, chunk_index, key):
    return os.path.join(parts_dir, f"chunk{chunk_index:09d}_{key}")


def encode_to_parts(task):
    """Worker: encode one chunk and write one partial dataset per json key."""
    chunk, parts_dir = task
    encoded = encode_in_process(chunk)
    for key, documents in encoded.documents_by_key.items():
        prefix = part_prefix(parts_dir, chunk.index, key)
        with IndexedDatasetBuilder(data_file_path(prefix), documents.tokens.dtype) as builder:
            builder.add_documents(documents.tokens, documents.sizes, documents.doc_item_counts)
            builder.finalize(index_file_path(prefix))
    return PartSummary(chunk.index, encoded.lines, encoded.nbytes, encoded.documents, encoded.tokens,
                       encoded.bad_lines)


def append_parts(builders, keys, parts_dir, chunk_index):
    """Append chunk ``chunk_index``'s partial datasets to the outputs, then delete them."""
    for key, builder in zip(keys, builders):
        prefix = part_prefix(parts_dir, chunk_index, key)
        builder.merge_file_(prefix)
        os.remove(data_file_path(prefix))
        os.remove(index_file_path(prefix))


def make_parts_directory(output_prefix):
    """A new directory for the partial datasets, next to the output; IndexedDatasetError naming the
    output and the cause when it cannot be made (read-only, full)."""
    output_dir = os.path.dirname(os.path.abspath(output_prefix))
    try:
        return tempfile.mkdtemp(prefix=f".{os.path.basename(output_prefix)}.parts.", suffix=".tmp", dir=output_dir)
    except OSError as error:
        raise IndexedDatasetError(f"--output-prefix {output_prefix}: cannot make a scratch directory in "
                                  f"{output_dir}: {error.strerror or error}") from error


def preprocess_many_cores(args):
    """Run the tool; returns (progress, report)."""
    encoder, paths, prefixes = prepare(args)
    keys = encoder.config.json_keys
    report = BadLineReport()
    progress = ProgressReporter(args.log_interval)
    parts_dir = make_parts_directory(args.output_prefix)
    try:
        with output_builders(prefixes, encoder.dtype, paths, keys, progress, report) as builders:
            set_process_encoder(encoder)
            tasks = ((chunk, parts_dir) for chunk in read_line_chunks(paths, args.chunk_size))
            with pool_context().Pool(args.workers, initializer=init_process_encoder,
                                     initargs=(encoder.config,)) as pool:
                in_flight = args.workers * CHUNKS_IN_FLIGHT_PER_WORKER
                for summary in map_in_order(pool, encode_to_parts, tasks, in_flight):
                    account_for_chunk(summary, report, progress, args.strict)
                    append_parts(builders, keys, parts_dir, summary.index)
    finally:
        shutil.rmtree(parts_dir, ignore_errors=True)
    print_summary(progress, report, prefixes)
    return progress, report


if __name__ == "__main__":
    sys.exit(run_tool(preprocess_many_cores, description=__doc__))
