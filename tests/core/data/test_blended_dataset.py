"""BlendedDataset: proportions, never past a child's end, many datasets, cached indices, pickling."""
import math
import os
import pickle

import numpy as np
import pytest

from megatron.core.data import blended_dataset
from megatron.core.data.blended_dataset import BlendedDataset
from megatron.core.data.gpt_dataset import DatasetConfigError, GPTDataset
from megatron.core.data.indexed_dataset import make_dataset
from tests.core.data.test_gpt_dataset import random_documents, write_dataset


class Labelled:
    """A child dataset whose sample j is (label, j), with a bounds check like a real dataset."""

    def __init__(self, label, length):
        self.label = label
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, j):
        if not 0 <= j < self.length:
            raise IndexError(j)
        return self.label, j


def children_for(weights, size):
    """Children sized as the builders ask: ceil(size * w * 1.005)."""
    total = sum(weights)
    return [Labelled(i, int(math.ceil(size * w / total * 1.005))) for i, w in enumerate(weights)]


def test_proportions_follow_weights_over_10k_samples():
    weights = [0.5, 0.3, 0.15, 0.05]
    size = 10_000
    blend = BlendedDataset(children_for(weights, size), weights, size)
    labels = np.array([blend[k][0] for k in range(size)])
    shares = np.bincount(labels, minlength=4) / size
    np.testing.assert_allclose(shares, weights, atol=0.01)
    # Each child is read in order 0, 1, 2, ... without gaps or repeats.
    for label in range(4):
        indices = [blend[k][1] for k in range(size) if blend[k][0] == label]
        assert indices == list(range(len(indices)))
    # Any prefix of the blend follows the weights too.
    np.testing.assert_allclose(np.bincount(labels[:1000], minlength=4) / 1000, weights, atol=0.01)


@pytest.mark.parametrize("seed", range(5))
def test_children_sized_as_builders_ask_are_never_read_past_their_end(seed):
    rng = np.random.default_rng(seed)
    weights = list(rng.dirichlet(np.full(6, 0.3)) + 1e-6)  # some extreme weights
    size = int(rng.integers(1, 20_000))
    children = children_for(weights, size)
    blend = BlendedDataset(children, weights, size)
    counts = np.bincount(blend.dataset_index, minlength=6)
    assert all(count <= len(child) for count, child in zip(counts, children))
    assert int(blend.dataset_sample_index.max()) < max(len(c) for c in children)


def test_too_small_child_raises_naming_the_dataset():
    with pytest.raises(DatasetConfigError, match=r"needs sample 10 of dataset 1.*\[1\] Labelled: 10"):
        BlendedDataset([Labelled(0, 1000), Labelled(1, 10)], [0.5, 0.5], 100, name="train")


def test_more_than_255_datasets():
    size = 3000
    weights = [1.0] * 300
    blend = BlendedDataset(children_for(weights, size), weights, size)
    assert blend.dataset_index.dtype == np.int32
    assert {blend[k][0] for k in range(size)} == set(range(300))


def test_weight_validation():
    with pytest.raises(DatasetConfigError, match="positive"):
        BlendedDataset([Labelled(0, 5), Labelled(1, 5)], [1.0, 0.0], 4)
    with pytest.raises(DatasetConfigError, match="2 datasets but 1 weights"):
        BlendedDataset([Labelled(0, 5), Labelled(1, 5)], [1.0], 4)


def test_cached_indices_are_reused_and_keyed_by_weights(tmp_path, monkeypatch):
    weights = [0.7, 0.3]
    blend = BlendedDataset(children_for(weights, 500), weights, 500, name="train",
                           cache_dir=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in blend.cache_paths.values())
    assert isinstance(blend.dataset_index, np.memmap)

    def must_not_build(*args, **kwargs):
        raise AssertionError("the cached blending indices should have been reused")

    monkeypatch.setattr(blended_dataset, "build_blending_indices", must_not_build)
    again = BlendedDataset(children_for(weights, 500), weights, 500, name="train",
                           cache_dir=str(tmp_path))
    np.testing.assert_array_equal(again.dataset_index, blend.dataset_index)
    monkeypatch.undo()
    other = BlendedDataset(children_for([0.6, 0.4], 500), [0.6, 0.4], 500, name="train",
                           cache_dir=str(tmp_path))
    assert set(other.cache_paths.values()).isdisjoint(blend.cache_paths.values())
    assert np.bincount(other.dataset_index)[0] == 300


def test_blend_of_gpt_datasets_returns_their_samples(tmp_path):
    prefixes = [write_dataset(str(tmp_path / f"d{i}"), random_documents(i)) for i in range(2)]
    size = 40
    children = [GPTDataset("train", p, make_dataset(p, "mmap"), np.arange(40),
                           int(math.ceil(size * w * 1.005)), 16, 3)
                for p, w in zip(prefixes, [0.25, 0.75])]
    blend = BlendedDataset(children, [0.25, 0.75], size, cache_dir=str(tmp_path))
    for k in range(size):
        child = children[int(blend.dataset_index[k])]
        np.testing.assert_array_equal(blend[k]["text"], child[int(blend.dataset_sample_index[k])]["text"])
    with pytest.raises(IndexError):
        blend[size]


def test_a_pickled_blend_maps_its_cached_indices_again(tmp_path):
    """A DataLoader worker receives the blend pickled: with a cache, its indices travel as paths."""
    weights, size = [0.7, 0.3], 20_000
    cached = BlendedDataset(children_for(weights, size), weights, size, cache_dir=str(tmp_path))
    clone = pickle.loads(pickle.dumps(cached))
    assert len(pickle.dumps(cached)) < 4096 and isinstance(clone.dataset_index, np.memmap)
    assert [clone[k] for k in range(0, size, 997)] == [cached[k] for k in range(0, size, 997)]
    in_memory = BlendedDataset(children_for(weights, size), weights, size)  # no cache: the arrays travel
    clone = pickle.loads(pickle.dumps(in_memory))
    assert len(pickle.dumps(in_memory)) > size and [clone[k] for k in range(0, size, 997)] == \
        [cached[k] for k in range(0, size, 997)]
