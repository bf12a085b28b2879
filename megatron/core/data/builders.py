"""Train/valid/test GPT datasets from a GPTDatasetConfig and the number of samples per split.

Option 1 (``config.data_path``): every prefix's documents are cut into train/valid/test ranges by
``config.split`` (Megatron's rounding); a split present in several prefixes becomes a
BlendedDataset of exactly the requested size, whose child i is asked for
``ceil(n * w_i * 1.005)`` samples (w normalised over the prefixes that have the split).

Option 2 (``config.train_groups`` etc.): each group is one dataset named after the group: a
GPTDataset over its single entry's document range, or a blend of its entries. The train flag has
one group; every valid/test group becomes its own named dataset.

A split asked for 0 samples, or whose document range is empty, is not built.
"""
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron.core.data.blended_dataset import BlendedDataset, normalized_weights
from megatron.core.data.data_paths import (DatasetGroup, range_document_boundaries,
                                           split_document_boundaries)
from megatron.core.data.gpt_dataset import DatasetConfigError, GPTDataset, GPTDatasetConfig
from megatron.core.data.indexed_dataset import make_dataset

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
BLEND_OVERSAMPLING = 1.005


@dataclass
class TrainValidTestDatasets:
    """train: one dataset or None; valid/test: (name, dataset) pairs, one per named set."""

    train: Any | None = None
    valid: list[tuple[str, Any]] = field(default_factory=list)
    test: list[tuple[str, Any]] = field(default_factory=list)


class _DatasetFactory:
    """Opens each indexed dataset once and builds GPT/blended datasets with shared settings."""

    def __init__(self, config: GPTDatasetConfig, group):
        self.config = config
        self.group = group
        self._opened: dict[str, Any] = {}

    def open(self, prefix):
        if prefix not in self._opened:
            self._opened[prefix] = make_dataset(prefix, self.config.data_impl,
                                                skip_warmup=not self.config.mmap_warmup)
        return self._opened[prefix]

    def gpt(self, name, prefix, first_doc, end_doc, num_samples):
        documents = np.arange(first_doc, end_doc, dtype=np.int64)
        return GPTDataset(name, prefix, self.open(prefix), documents, num_samples,
                          self.config.seq_length, self.config.seed,
                          cache_dir=self.config.data_cache_path, group=self.group,
                          vocab_size=self.config.vocab_size)

    def blend(self, name, parts, num_samples):
        """`parts`: (weight, prefix, first_doc, end_doc); one part -> a plain GPTDataset."""
        if len(parts) == 1:
            _, prefix, first_doc, end_doc = parts[0]
            return self.gpt(name, prefix, first_doc, end_doc, num_samples)
        weights = normalized_weights([p[0] for p in parts])
        children = [self.gpt(name, prefix, first_doc, end_doc,
                             int(math.ceil(num_samples * w * BLEND_OVERSAMPLING)))
                    for w, (_, prefix, first_doc, end_doc) in zip(weights, parts)]
        cache_dir = self.config.data_cache_path or os.path.dirname(os.path.abspath(parts[0][1]))
        return BlendedDataset(children, weights, num_samples, name=name, cache_dir=cache_dir,
                              group=self.group)


def _check_num_samples(values):
    values = list(values)
    if len(values) != 3 or any(isinstance(v, bool) or not isinstance(v, (int, np.integer))
                               or v < 0 for v in values):
        raise DatasetConfigError(
            f"train_valid_test_num_samples must be 3 non-negative integers, got {values!r}")
    return [int(v) for v in values]


def _build_option1(factory, num_samples):
    config = factory.config
    boundaries = {p.prefix: split_document_boundaries(config.split, len(factory.open(p.prefix)))
                  for p in config.data_path}
    built = {}
    for index, split_name in enumerate(SPLIT_NAMES):
        parts = [(p.weight, p.prefix, boundaries[p.prefix][index], boundaries[p.prefix][index + 1])
                 for p in config.data_path]
        present = [part for part in parts if part[3] > part[2]]
        if len(present) < len(parts):
            logger.warning("%s split: no documents in %s; blending the others",
                           split_name, ", ".join(p[1] for p in parts if p[3] <= p[2]))
        if num_samples[index] > 0 and present:
            built[split_name] = factory.blend(split_name, present, num_samples[index])
    return TrainValidTestDatasets(
        train=built.get("train"),
        valid=[("valid", built["valid"])] if "valid" in built else [],
        test=[("test", built["test"])] if "test" in built else [])


def _build_group(factory, group: DatasetGroup, num_samples):
    parts = []
    for entry in group.entries:
        num_documents = len(factory.open(entry.prefix))
        first_doc, end_doc = range_document_boundaries(entry.start, entry.end, num_documents)
        if end_doc <= first_doc:
            raise DatasetConfigError(
                f"group {group.name!r}: range {entry.start}:{entry.end} of {entry.prefix} "
                f"({num_documents} documents) holds no document")
        parts.append((entry.weight, entry.prefix, first_doc, end_doc))
    return factory.blend(group.name, parts, num_samples)


def _build_option2(factory, num_samples):
    config = factory.config
    datasets = TrainValidTestDatasets()
    if num_samples[0] > 0:
        datasets.train = _build_group(factory, config.train_groups[0], num_samples[0])
    for groups, target, n in ((config.valid_groups, datasets.valid, num_samples[1]),
                              (config.test_groups, datasets.test, num_samples[2])):
        if n > 0:
            target.extend((g.name, _build_group(factory, g, n)) for g in groups)
    return datasets


def build_train_valid_test_datasets(config: GPTDatasetConfig,
                                    train_valid_test_num_samples: Sequence[int],
                                    group=None) -> TrainValidTestDatasets:
    """Build the datasets of `config` with (train, valid, test) numbers of samples.

    Every rank of `group` (default: the world, when torch.distributed is initialised) must call
    this; index caches are built by the group's first rank and memory-mapped by all.
    """
    num_samples = _check_num_samples(train_valid_test_num_samples)
    factory = _DatasetFactory(config, group)
    if config.data_path:
        datasets = _build_option1(factory, num_samples)
    else:
        datasets = _build_option2(factory, num_samples)
    logger.info("datasets: train %s, valid %s, test %s",
                None if datasets.train is None else len(datasets.train),
                [(n, len(d)) for n, d in datasets.valid], [(n, len(d)) for n, d in datasets.test])
    return datasets
