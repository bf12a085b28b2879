"""Build (or check) the cached GPT dataset indices of a training run ahead of time.

Takes the training run's data flags (``--data-path``/``--split`` or the weighted split paths,
``--seq-length``, ``--seed``, ``--data-cache-path``) and its length flags, computes the number of
samples of each split as the trainer does:

    train = --train-samples, or --train-iters * --global-batch-size
    valid = (train_iters // --eval-interval + 1) * --eval-iters * --global-batch-size
    test  = --eval-iters * --global-batch-size

then builds the doc/sample/shuffle (and blending) index caches, so a large run does not spend its
first minutes, and its collective timeouts, building them. Prints what was built.
"""
import argparse
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.data.builders import TrainValidTestDatasets, build_train_valid_test_datasets  # noqa: E402
from megatron.core.data.gpt_dataset import DatasetConfigError, IndexCacheError  # noqa: E402
from megatron.core.data.indexed_dataset import IndexedDatasetError  # noqa: E402
from megatron.training.config import dataset_config_from_args  # noqa: E402
from megatron.training.data_loading import train_valid_test_num_samples  # noqa: E402

GROUP_FLAGS = ("train", "valid", "test")
# Bad data or an unwritable index cache: one line naming the file, no traceback.
DATA_ERRORS = (DatasetConfigError, IndexCacheError, IndexedDatasetError)


def run_data_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the run's data flags and length flags (the trainer's names), for the tools that
    build or read the run's datasets."""
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    data = parser.add_argument_group("data")
    data.add_argument("--data-path", nargs="*", default=None,
                      help="PREFIX, or a weighted list W1 PREFIX1 W2 PREFIX2 ...")
    data.add_argument("--split", default=None, help='train/valid/test proportions (default "969, 30, 1")')
    for name in GROUP_FLAGS:
        groups = data.add_mutually_exclusive_group()
        groups.add_argument(f"--{name}-weighted-split-paths", nargs="*", default=None,
                            help='named groups "NAME: W1 S1:E1 PATH1, W2 S2:E2 PATH2"')
        groups.add_argument(f"--{name}-weighted-split-paths-path", default=None,
                            help=f"file holding the quoted groups of --{name}-weighted-split-paths")
    data.add_argument("--data-impl", default="infer", choices=["mmap", "infer", "lazy", "cached"])
    data.add_argument("--data-cache-path", default=None, help="where index caches go (default: next to the data)")
    data.add_argument("--mmap-warmup", action="store_true", help="read the whole .idx/.bin once at open")
    data.add_argument("--seq-length", type=int, required=True)
    data.add_argument("--seed", type=int, default=1234)
    run = parser.add_argument_group("run length")
    run.add_argument("--train-iters", type=int, default=None)
    run.add_argument("--train-samples", type=int, default=None)
    run.add_argument("--global-batch-size", type=int, required=True)
    run.add_argument("--eval-interval", type=int, default=1000)
    run.add_argument("--eval-iters", type=int, default=100)
    return parser


def check_run_length(parser: argparse.ArgumentParser, args) -> None:
    """The rules of the length flags (argparse's error and exit status 2)."""
    if (args.train_iters is None) == (args.train_samples is None):
        parser.error("give exactly one of --train-iters and --train-samples")
    if args.split is not None and not args.data_path:
        parser.error("--split applies to --data-path only")


def parse_args(argv=None):
    parser = run_data_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    check_run_length(parser, args)
    return args


def train_iterations(args) -> int:
    """--train-iters, or the whole global batches --train-samples makes (without a batch rampup)."""
    return args.train_iters if args.train_iters is not None else args.train_samples // args.global_batch_size


def run_datasets(args) -> tuple[TrainValidTestDatasets, tuple[int, int, int]]:
    """The run's train/valid/test datasets, as the trainer builds them (index caches built or reused),
    and the requested sample counts; exits with a message naming a bad data flag."""
    try:
        config = dataset_config_from_args(args, args.seq_length)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    if config is None:
        sys.exit("error: no data: give --data-path or --train-weighted-split-paths[-path]")
    num_samples = train_valid_test_num_samples(train_iterations(args), args.global_batch_size, args.train_samples,
                                               args.eval_interval, args.eval_iters)
    try:
        return build_train_valid_test_datasets(config, num_samples), num_samples
    except DATA_ERRORS as exc:
        sys.exit(f"error: {exc}")


def describe(kind, name, dataset, seq_length):
    if dataset is None:
        return f"  {kind:<5} {name:<24} not built (no samples or no documents)"
    return f"  {kind:<5} {name:<24} {len(dataset):>12,} samples of {seq_length + 1} tokens"


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    start = time.perf_counter()
    datasets, num_samples = run_datasets(args)
    elapsed = time.perf_counter() - start
    print(f"dataset indices ready in {elapsed:.2f} s (requested train/valid/test samples: "
          f"{num_samples[0]:,} / {num_samples[1]:,} / {num_samples[2]:,})")
    print(describe("train", "train", datasets.train, args.seq_length))
    for kind, pairs in (("valid", datasets.valid), ("test", datasets.test)):
        for name, dataset in pairs:
            print(describe(kind, name, dataset, args.seq_length))
    cache = args.data_cache_path or "next to each dataset's .bin/.idx"
    print(f"  index caches: {cache}")


if __name__ == "__main__":
    main()
