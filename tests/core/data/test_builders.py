"""build_train_valid_test_datasets: Option 1 (split, blends) and Option 2 (named groups)."""
import math
import os

import numpy as np
import pytest

from megatron.core.data.blended_dataset import BlendedDataset
from megatron.core.data.builders import build_train_valid_test_datasets
from megatron.core.data.data_paths import (parse_data_path, parse_split,
                                           parse_weighted_split_paths)
from megatron.core.data.gpt_dataset import DatasetConfigError, GPTDataset, GPTDatasetConfig
from tests.core.data.test_gpt_dataset import random_documents, write_dataset


@pytest.fixture
def prefixes(tmp_path):
    return [write_dataset(str(tmp_path / name), random_documents(seed, count=40))
            for seed, name in enumerate(["a", "b"])]


def documents_used(dataset):
    return set(int(d) for d in dataset.doc_idx)


def test_option1_single_prefix_splits_documents(prefixes):
    config = GPTDatasetConfig(seq_length=16, seed=1, data_path=parse_data_path([prefixes[0]]),
                              split=parse_split("8,1,1"))
    datasets = build_train_valid_test_datasets(config, [50, 10, 5])
    assert isinstance(datasets.train, GPTDataset) and len(datasets.train) >= 50
    assert [name for name, _ in datasets.valid] == ["valid"]
    assert [name for name, _ in datasets.test] == ["test"]
    assert documents_used(datasets.train) == set(range(0, 32))
    assert documents_used(datasets.valid[0][1]) == set(range(32, 36))
    assert documents_used(datasets.test[0][1]) == set(range(36, 40))
    assert len(datasets.valid[0][1]) >= 10 and len(datasets.test[0][1]) >= 5


def test_option1_empty_split_and_zero_samples_are_not_built(prefixes):
    config = GPTDatasetConfig(seq_length=16, seed=1, data_path=parse_data_path([prefixes[0]]))
    # "969, 30, 1" of 40 documents: valid gets round(1.2) = 1 document, test none.
    datasets = build_train_valid_test_datasets(config, [20, 0, 5])
    assert datasets.train is not None and datasets.valid == [] and datasets.test == []


def test_option1_blend_skips_a_prefix_without_documents_in_a_split(prefixes, tmp_path):
    tiny = write_dataset(str(tmp_path / "tiny"), random_documents(7, count=3))
    config = GPTDatasetConfig(seq_length=16, seed=1,
                              data_path=parse_data_path(["0.5", prefixes[0], "0.5", tiny]))
    # "969, 30, 1": 3 documents give the tiny prefix no valid document; prefix a has one.
    datasets = build_train_valid_test_datasets(config, [20, 4, 0])
    assert isinstance(datasets.train, BlendedDataset)
    valid = datasets.valid[0][1]
    assert isinstance(valid, GPTDataset) and valid.data_prefix == prefixes[0]
    assert documents_used(valid) == {39}


def test_option1_blend_follows_weights(prefixes, tmp_path):
    config = GPTDatasetConfig(seq_length=8, seed=3,
                              data_path=parse_data_path(["0.3", prefixes[0], "0.7", prefixes[1]]),
                              split=parse_split("90/10/0"), data_cache_path=str(tmp_path / "cache"))
    datasets = build_train_valid_test_datasets(config, [400, 20, 0])
    train = datasets.train
    assert isinstance(train, BlendedDataset) and len(train) == 400
    shares = np.bincount(train.dataset_index, minlength=2) / 400
    np.testing.assert_allclose(shares, [0.3, 0.7], atol=0.01)
    for child, weight in zip(train.datasets, [0.3, 0.7]):
        assert len(child) >= math.ceil(400 * weight * 1.005)
        assert documents_used(child) <= set(range(36))
    valid_name, valid = datasets.valid[0]
    assert valid_name == "valid" and len(valid) == 20
    assert all(documents_used(child) <= set(range(36, 40)) for child in valid.datasets)
    sample = train[0]["text"]
    assert sample.shape == (9,)
    cache_files = os.listdir(tmp_path / "cache")
    assert any(f.startswith("blended_train_400ns_") for f in cache_files)
    assert any(f.startswith("a_train_indexmap_") for f in cache_files)


def test_option2_named_groups(prefixes):
    a, b = prefixes
    config = GPTDatasetConfig(
        seq_length=16, seed=2,
        train_groups=parse_weighted_split_paths([f"TRAIN: 1 0:0.8 {a}, 1 0:0.8 {b}"],
                                                "--train-weighted-split-paths"),
        valid_groups=parse_weighted_split_paths([f"VALID_A: 1 0.8:1 {a}", f"VALID_B: 1 0.8:1 {b}"],
                                                "--valid-weighted-split-paths"))
    datasets = build_train_valid_test_datasets(config, [100, 12, 0])
    assert isinstance(datasets.train, BlendedDataset) and len(datasets.train) == 100
    assert [c.name for c in datasets.train.datasets] == ["TRAIN", "TRAIN"]
    assert [name for name, _ in datasets.valid] == ["VALID_A", "VALID_B"]
    for (_, valid), prefix in zip(datasets.valid, prefixes):
        assert isinstance(valid, GPTDataset) and valid.data_prefix == prefix
        assert documents_used(valid) == set(range(32, 40)) and len(valid) >= 12
    assert datasets.test == []


def test_option2_empty_range_names_the_group(prefixes):
    config = GPTDatasetConfig(
        seq_length=16, seed=2,
        train_groups=parse_weighted_split_paths([f"TRAIN: 1 0.99:1 {prefixes[0]}"],
                                                "--train-weighted-split-paths"))
    with pytest.raises(DatasetConfigError, match="group 'TRAIN': range 0.99:1.0 .* holds no document"):
        build_train_valid_test_datasets(config, [10, 0, 0])


def test_num_samples_validation(prefixes):
    config = GPTDatasetConfig(seq_length=16, seed=1, data_path=parse_data_path([prefixes[0]]))
    with pytest.raises(DatasetConfigError, match="3 non-negative integers"):
        build_train_valid_test_datasets(config, [10, -1, 0])
