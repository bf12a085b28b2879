"""Concatenate mmap indexed datasets: ``--datasets A B C --output-prefix OUT``.

OUT holds every document of A, then of B, then of C, with document boundaries kept and 64-bit
pointers rebased; merging the outputs of preprocessing shards equals preprocessing their
concatenation, byte for byte. All datasets must share one token dtype. OUT is written under
temporary names and renamed when complete.

Example:
    python tools/merge_preprocessed_data.py \
        --datasets data/shard0_text_document data/shard1_text_document \
        --output-prefix data/all_text_document
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.data.indexed_dataset import (  # noqa: E402
    IndexedDatasetBuilder,
    IndexedDatasetError,
    MMapIndexedDataset,
    data_file_path,
    index_file_path,
    make_dataset,
    make_output_directory,
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", nargs="+", required=True,
                        help="prefixes of the datasets to concatenate, in order (without .bin/.idx)")
    parser.add_argument("--output-prefix", required=True, help="prefix of the merged dataset")
    parser.add_argument("--merge", choices=["serial", "distributed"], default="serial",
                        help="only serial is supported")
    return parser.parse_args(argv)


def check_datasets(prefixes, output_prefix):
    """Open every input (validating it) and return the common dtype; errors name the files."""
    if output_is_an_input(prefixes, output_prefix):
        raise IndexedDatasetError(f"--output-prefix {output_prefix} is also one of --datasets")
    datasets = [make_dataset(prefix, impl="infer") for prefix in prefixes]
    dtype = datasets[0].dtype
    for prefix, dataset in zip(prefixes[1:], datasets[1:]):
        if dataset.dtype != dtype:
            raise IndexedDatasetError(
                f"cannot merge {data_file_path(prefix)} (dtype {dataset.dtype}) with "
                f"{data_file_path(prefixes[0])} (dtype {dtype}): all datasets need the same dtype")
    return dtype


def output_is_an_input(prefixes, output_prefix):
    output = os.path.abspath(output_prefix)
    return any(os.path.abspath(prefix) == output for prefix in prefixes)


def merge_datasets(prefixes, output_prefix):
    """Write the concatenation of ``prefixes`` to ``output_prefix``; returns the merged dataset."""
    dtype = check_datasets(prefixes, output_prefix)
    make_output_directory(os.path.dirname(os.path.abspath(output_prefix)), f"--output-prefix {output_prefix}")
    with IndexedDatasetBuilder(data_file_path(output_prefix), dtype) as builder:
        for prefix in prefixes:
            builder.merge_file_(prefix)
        builder.finalize(index_file_path(output_prefix))
    return MMapIndexedDataset(output_prefix)


def main(argv=None):
    args = parse_args(argv)
    if args.merge != "serial":
        print("error: --merge distributed is not supported; use --merge serial", file=sys.stderr)
        return 1
    try:
        merged = merge_datasets(args.datasets, args.output_prefix)
    except IndexedDatasetError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"Merged {len(args.datasets)} datasets into {args.output_prefix}.bin/.idx: "
          f"{len(merged.doc_idx) - 1} documents, {len(merged)} items, "
          f"{int(merged.sizes.sum(dtype='int64'))} tokens of {merged.dtype}.", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
