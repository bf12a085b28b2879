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

from megatron.core.data.builders import build_train_valid_test_datasets  # noqa: E402
from megatron.core.data.data_paths import (DataPathError, parse_data_path, parse_split,  # noqa: E402
                                           parse_weighted_split_paths,
                                           read_weighted_split_paths_file)
from megatron.core.data.gpt_dataset import GPTDatasetConfig  # noqa: E402

GROUP_FLAGS = ("train", "valid", "test")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    data = parser.add_argument_group("data")
    data.add_argument("--data-path", nargs="*", default=None,
                      help="PREFIX, or a weighted list W1 PREFIX1 W2 PREFIX2 ...")
    data.add_argument("--split", default=None, help='train/valid/test proportions (default "969, 30, 1")')
    for name in GROUP_FLAGS:
        data.add_argument(f"--{name}-weighted-split-paths", nargs="*", default=None,
                          help='named groups "NAME: W1 S1:E1 PATH1, W2 S2:E2 PATH2"')
        data.add_argument(f"--{name}-weighted-split-paths-path", default=None,
                          help=f"file holding the quoted groups of --{name}-weighted-split-paths")
    data.add_argument("--data-impl", default="infer", choices=["mmap", "infer", "lazy", "cached"])
    data.add_argument("--data-cache-path", default=None, help="where index caches go (default: next to the data)")
    data.add_argument("--seq-length", type=int, required=True)
    data.add_argument("--seed", type=int, default=1234)
    run = parser.add_argument_group("run length")
    run.add_argument("--train-iters", type=int, default=None)
    run.add_argument("--train-samples", type=int, default=None)
    run.add_argument("--global-batch-size", type=int, required=True)
    run.add_argument("--eval-interval", type=int, default=1000)
    run.add_argument("--eval-iters", type=int, default=100)
    args = parser.parse_args(argv)
    if (args.train_iters is None) == (args.train_samples is None):
        parser.error("give exactly one of --train-iters and --train-samples")
    return args


def split_num_samples(args):
    """(train, valid, test) sample counts, with the trainer's formulas (module docstring)."""
    gbs = args.global_batch_size
    if args.train_samples is not None:
        train_samples, train_iters = args.train_samples, args.train_samples // gbs
    else:
        train_samples, train_iters = args.train_iters * gbs, args.train_iters
    valid = (train_iters // args.eval_interval + 1) * args.eval_iters * gbs
    return train_samples, valid, args.eval_iters * gbs


def named_groups(args, name):
    values = getattr(args, f"{name}_weighted_split_paths")
    path = getattr(args, f"{name}_weighted_split_paths_path")
    flag = f"--{name}-weighted-split-paths"
    if values is not None and path is not None:
        raise DataPathError(f"{flag} and {flag}-path are exclusive")
    if path is not None:
        return read_weighted_split_paths_file(path, f"{flag}-path")
    return parse_weighted_split_paths(values, flag) if values is not None else ()


def dataset_config(args):
    groups = {name: named_groups(args, name) for name in GROUP_FLAGS}
    common = dict(seq_length=args.seq_length, seed=args.seed, data_impl=args.data_impl,
                  data_cache_path=args.data_cache_path)
    if args.data_path:
        if any(groups.values()):
            raise DataPathError("--data-path and --*-weighted-split-paths are exclusive")
        split = parse_split(args.split) if args.split is not None else parse_split()
        return GPTDatasetConfig(data_path=parse_data_path(args.data_path), split=split, **common)
    if args.split is not None:
        raise DataPathError("--split applies to --data-path only")
    return GPTDatasetConfig(train_groups=groups["train"], valid_groups=groups["valid"],
                            test_groups=groups["test"], **common)


def describe(kind, name, dataset):
    if dataset is None:
        return f"  {kind:<5} {name:<24} not built (no samples or no documents)"
    return f"  {kind:<5} {name:<24} {len(dataset):>12,} samples of {dataset_seq_length(dataset) + 1} tokens"


def dataset_seq_length(dataset):
    return len(dataset[0]["text"]) - 1


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    try:
        config = dataset_config(args)
    except (DataPathError, ValueError) as exc:
        sys.exit(f"error: {exc}")
    num_samples = split_num_samples(args)
    start = time.perf_counter()
    datasets = build_train_valid_test_datasets(config, num_samples)
    elapsed = time.perf_counter() - start
    print(f"dataset indices ready in {elapsed:.2f} s (requested train/valid/test samples: "
          f"{num_samples[0]:,} / {num_samples[1]:,} / {num_samples[2]:,})")
    print(describe("train", "train", datasets.train))
    for kind, pairs in (("valid", datasets.valid), ("test", datasets.test)):
        for name, dataset in pairs:
            print(describe(kind, name, dataset))
    cache = args.data_cache_path or "next to each dataset's .bin/.idx"
    print(f"  index caches: {cache}")


if __name__ == "__main__":
    main()
