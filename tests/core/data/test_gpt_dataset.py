"""GPTDataset: samples against a brute-force concatenation, caching, 64-bit indexing, two ranks."""
import os
import pickle
import re

import numpy as np
import pytest
from torch.utils.data import DataLoader

from megatron.core.data import gpt_dataset
from megatron.core.data.data_paths import DatasetGroup, GroupEntry, WeightedPrefix
from megatron.core.data.gpt_dataset import (DatasetConfigError, GPTDataset, GPTDatasetConfig,
                                            IndexCacheError)
from megatron.core.data.indexed_dataset import IndexedDatasetBuilder, IndexedDatasetError, make_dataset
from tests.dist_utils import run_distributed


def write_dataset(prefix, documents, dtype=np.uint16):
    """Write `documents` (lists of token ids) as an mmap indexed dataset at `prefix`."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for tokens in documents:
        builder.add_item(np.asarray(tokens, dtype=dtype))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


def random_documents(seed, count=40, max_length=60):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50000, size=rng.integers(0, max_length)) for _ in range(count)]


def expected_sample(documents, doc_idx, seq_length, position):
    """Tokens [p*s, p*s + s + 1) of the documents concatenated in doc_idx order."""
    stream = np.concatenate([np.asarray(documents[d], dtype=np.int64) for d in doc_idx])
    return stream[position * seq_length: position * seq_length + seq_length + 1]


@pytest.fixture
def corpus(tmp_path):
    documents = random_documents(0)
    return documents, write_dataset(str(tmp_path / "corpus"), documents)


def make_gpt(prefix, num_samples, seq_length, seed, documents=None, **kwargs):
    indexed = make_dataset(prefix, "mmap")
    if documents is None:
        documents = np.arange(len(indexed))
    return GPTDataset("train", prefix, indexed, documents, num_samples, seq_length, seed, **kwargs)


@pytest.mark.parametrize("num_samples,seq_length", [(10, 16), (300, 16), (150, 7), (5, 200)])
def test_samples_equal_brute_force_concatenation(corpus, num_samples, seq_length):
    documents, prefix = corpus
    split = np.arange(5, 35)  # a document range, as a split gives
    ds = make_gpt(prefix, num_samples, seq_length, 1234, documents=split)
    tokens_per_epoch = sum(len(documents[d]) for d in split)
    epochs = ds.doc_idx.shape[0] // len(split)
    assert (epochs * tokens_per_epoch - 1) // seq_length >= num_samples
    assert epochs == 1 or ((epochs - 1) * tokens_per_epoch - 1) // seq_length < num_samples
    assert len(ds) == (epochs * tokens_per_epoch - 1) // seq_length
    np.testing.assert_array_equal(np.bincount(ds.doc_idx, minlength=40)[split], epochs)
    np.testing.assert_array_equal(np.sort(ds.shuffle_idx), np.arange(len(ds)))
    stream = np.concatenate([np.asarray(documents[d], dtype=np.int64) for d in ds.doc_idx])
    for i in range(len(ds)):
        text = ds[i]["text"]
        position = int(ds.shuffle_idx[i])
        assert text.dtype == np.int64 and text.shape == (seq_length + 1,)
        np.testing.assert_array_equal(
            text, stream[position * seq_length: position * seq_length + seq_length + 1])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_shuffles_follow_megatron_recipe(corpus):
    documents, prefix = corpus
    single = make_gpt(prefix, 10, 16, 7)
    expected = np.arange(40, dtype=np.int64)
    np.random.RandomState(7).shuffle(expected)
    np.testing.assert_array_equal(single.doc_idx, expected)

    # Two epochs where the second is needed for a few samples: shuffled separately.
    samples_per_epoch = (sum(len(d) for d in documents) - 1) // 16
    ds = make_gpt(prefix, samples_per_epoch + 5, 16, 7)
    assert ds.doc_idx.shape[0] == 80
    np.testing.assert_array_equal(np.sort(ds.doc_idx[40:]), np.arange(40))
    first_epoch_samples = (sum(len(d) for d in documents) - 1) // 16
    assert ds.shuffle_idx[:first_epoch_samples].max() < first_epoch_samples
    assert ds.shuffle_idx[first_epoch_samples:].min() >= first_epoch_samples


def test_cache_names_and_reuse(corpus, monkeypatch):
    _, prefix = corpus
    ds = make_gpt(prefix, 20, 16, 99)
    pattern = re.escape(prefix) + r"_train_indexmap_20ns_16sl_99s_[0-9a-f]{16}_(doc|sample|shuffle)_idx\.npy"
    for path in ds.cache_paths.values():
        assert re.fullmatch(pattern, path) and os.path.isfile(path)
    assert isinstance(ds.doc_idx, np.memmap)

    def must_not_build(*args, **kwargs):
        raise AssertionError("the cached indices should have been reused")

    monkeypatch.setattr(gpt_dataset, "build_index_arrays", must_not_build)
    again = make_gpt(prefix, 20, 16, 99)
    np.testing.assert_array_equal(again.shuffle_idx, ds.shuffle_idx)


def test_rebuild_after_deleting_cache_is_identical_and_seed_changes_order(corpus):
    _, prefix = corpus
    first = make_gpt(prefix, 50, 16, 5)
    samples = [first[i]["text"].copy() for i in range(len(first))]
    for path in first.cache_paths.values():
        os.remove(path)
    rebuilt = make_gpt(prefix, 50, 16, 5)
    for i, sample in enumerate(samples):
        np.testing.assert_array_equal(rebuilt[i]["text"], sample)
    other = make_gpt(prefix, 50, 16, 6)
    assert set(other.cache_paths.values()).isdisjoint(first.cache_paths.values())
    assert not np.array_equal(other.doc_idx, rebuilt.doc_idx)
    assert any(not np.array_equal(other[i]["text"], samples[i]) for i in range(len(samples)))


def test_changed_dataset_does_not_reuse_cache(tmp_path):
    prefix = str(tmp_path / "data")
    write_dataset(prefix, random_documents(1))
    before = make_gpt(prefix, 30, 16, 3)
    changed = random_documents(2)
    write_dataset(prefix, changed)
    after = make_gpt(prefix, 30, 16, 3)
    assert set(after.cache_paths.values()).isdisjoint(before.cache_paths.values())
    for i in range(len(after)):
        np.testing.assert_array_equal(
            after[i]["text"], expected_sample(changed, after.doc_idx, 16, int(after.shuffle_idx[i])))


def test_cache_dir_and_unwritable_location(corpus, tmp_path):
    documents, prefix = corpus
    cache_dir = tmp_path / "cache"
    ds = make_gpt(prefix, 10, 16, 1, cache_dir=str(cache_dir))
    assert all(os.path.dirname(p) == str(cache_dir) for p in ds.cache_paths.values())
    assert not any(name.endswith("_idx.npy") for name in os.listdir(tmp_path))
    indexed = make_dataset(prefix, "mmap")
    with pytest.raises(IndexCacheError, match="--data-cache-path"):
        GPTDataset("train", "/proc/no-such-dir/data", indexed, np.arange(40), 10, 16, 1)


def test_pickled_dataset_remaps_its_indices(corpus):
    _, prefix = corpus
    ds = make_gpt(prefix, 12, 16, 2)
    clone = pickle.loads(pickle.dumps(ds))
    assert len(pickle.dumps(ds)) < 4096  # indices travel as paths, not contents
    for i in range(len(ds)):
        np.testing.assert_array_equal(clone[i]["text"], ds[i]["text"])


class SyntheticIndexedDataset:
    """Only sizes are stored; token t of item d is (d * 1_000_003 + t) % 65_521."""

    def __init__(self, sizes):
        self.sizes = np.asarray(sizes)

    def __len__(self):
        return len(self.sizes)

    def get(self, idx, offset=0, length=None):
        if length is None:
            length = int(self.sizes[idx]) - offset
        assert 0 <= offset and offset + length <= int(self.sizes[idx])
        return (idx * 1_000_003 + np.arange(offset, offset + length, dtype=np.int64)) % 65_521


def test_sparse_dataset_beyond_2_pow_32_tokens(tmp_path):
    sizes = np.array([2**31 - 1, 5, 2**31 - 1, 2**31 - 1, 0, 7], dtype=np.int32)
    indexed = SyntheticIndexedDataset(sizes)
    seq_length = 2**16
    tokens_per_epoch = int(sizes.sum(dtype=np.int64))
    assert tokens_per_epoch > 2**32
    num_samples = (tokens_per_epoch - 1) // seq_length + 1000  # a second epoch
    ds = GPTDataset("train", str(tmp_path / "sparse"), indexed, np.arange(6), num_samples,
                    seq_length, 11)
    assert ds.sample_idx.dtype == np.int64 and len(ds) >= num_samples
    order = [int(d) for d in ds.doc_idx]
    starts = np.concatenate([[0], np.cumsum([int(sizes[d]) for d in order])])  # Python ints
    for i in [0, 1, len(ds) // 2, len(ds) - 2, len(ds) - 1] + list(range(7, len(ds), 9973)):
        position = int(ds.shuffle_idx[i])
        first = position * seq_length
        pieces = []
        for k, doc in enumerate(order):
            lo, hi = max(first, int(starts[k])), min(first + seq_length + 1, int(starts[k + 1]))
            if lo < hi:
                pieces.append(indexed.get(doc, lo - int(starts[k]), hi - lo))
        np.testing.assert_array_equal(ds[i]["text"], np.concatenate(pieces))
    assert int(ds.shuffle_idx.max()) * seq_length > 2**32


def test_argument_validation(corpus):
    _, prefix = corpus
    indexed = make_dataset(prefix, "mmap")
    with pytest.raises(DatasetConfigError, match="document ids"):
        GPTDataset("train", prefix, indexed, np.array([0, 40]), 5, 16, 1)
    with pytest.raises(DatasetConfigError, match="seq_length"):
        GPTDataset("train", prefix, indexed, np.arange(3), 5, 0, 1)
    with pytest.raises(DatasetConfigError, match="seed"):
        GPTDataset("train", prefix, indexed, np.arange(3), 5, 16, -1)
    with pytest.raises(DatasetConfigError, match="num_samples"):
        GPTDataset("train", prefix, indexed, np.arange(3), -5, 16, 1)


def test_config_validation():
    option1 = (WeightedPrefix(1.0, "a"),)
    group = DatasetGroup("g", (GroupEntry(1.0, 0.0, 1.0, "a"),))
    assert GPTDatasetConfig(seq_length=8, seed=1, data_path=option1).split[0] == pytest.approx(0.969)
    with pytest.raises(DatasetConfigError, match="exclusive"):
        GPTDatasetConfig(seq_length=8, seed=1, data_path=option1, train_groups=(group,))
    with pytest.raises(DatasetConfigError, match="no data"):
        GPTDatasetConfig(seq_length=8, seed=1)
    with pytest.raises(DatasetConfigError, match="exactly one group"):
        GPTDatasetConfig(seq_length=8, seed=1, valid_groups=(group,))
    with pytest.raises(DatasetConfigError, match="seq_length"):
        GPTDatasetConfig(seq_length=0, seed=1, data_path=option1)


def test_samples_are_checked_against_the_vocabulary_naming_the_item(tmp_path):
    """Every sample holding an id outside [0, vocab_size) raises, naming the .bin and the item the id is in;
    the other samples read as without the check."""
    documents = [np.arange(20) % 7 for _ in range(10)]
    documents[6] = documents[6].copy()
    documents[6][12] = 7
    prefix = write_dataset(str(tmp_path / "bad"), documents)
    checked = make_gpt(prefix, 20, 8, 3, cache_dir=str(tmp_path), vocab_size=7)
    unchecked = make_gpt(prefix, 20, 8, 3, cache_dir=str(tmp_path))
    failed = []
    for i in range(len(checked)):
        expected = unchecked[i]["text"]
        if expected.max() < 7:
            assert np.array_equal(checked[i]["text"], expected)
            continue
        with pytest.raises(IndexedDatasetError) as error:
            checked[i]
        assert str(error.value) == (f"{prefix}.bin: sample {i} of the train data holds token ids in [0, 7], outside "
                                    f"the tokenizer's vocabulary [0, 7) (item 6): the dataset is damaged or was "
                                    f"tokenized with another tokenizer")
        failed.append(i)
    assert len(failed) in (1, 2)  # the id is in one sample, or in the token two samples share
    loader = DataLoader(checked, batch_size=None, sampler=failed[-1:], num_workers=1)
    with pytest.raises(IndexedDatasetError) as from_worker:
        next(iter(loader))
    assert str(from_worker.value) == str(error.value)  # one line, without the worker's traceback
    with pytest.raises(DatasetConfigError, match="vocab_size must be a positive integer"):
        GPTDatasetConfig(seq_length=8, seed=1, data_path=(WeightedPrefix(1.0, "a"),), vocab_size=0)


def _two_ranks_build(rank, world_size, prefix, work_dir):
    indexed = make_dataset(prefix, "mmap")
    original = gpt_dataset.build_index_arrays

    def failing(*args, **kwargs):
        raise RuntimeError("boom on the builder")

    def logged(*args, **kwargs):
        open(os.path.join(work_dir, f"built-by-rank-{rank}"), "w").close()
        return original(*args, **kwargs)

    # A failed build raises on every rank instead of leaving the others waiting.
    gpt_dataset.build_index_arrays = failing
    expected = RuntimeError if rank == 0 else IndexCacheError
    with pytest.raises(expected, match="boom on the builder"):
        GPTDataset("train", prefix, indexed, np.arange(40), 30, 16, 8,
                   cache_dir=os.path.join(work_dir, "failed"))

    gpt_dataset.build_index_arrays = logged
    ds = GPTDataset("train", prefix, indexed, np.arange(40), 30, 16, 8,
                    cache_dir=os.path.join(work_dir, "cache"))
    stats = [(os.stat(p).st_ino, os.stat(p).st_mtime_ns) for p in ds.cache_paths.values()]
    np.save(os.path.join(work_dir, f"stats-{rank}.npy"), np.array(stats))
    np.save(os.path.join(work_dir, f"samples-{rank}.npy"),
            np.stack([ds[i]["text"] for i in range(len(ds))]))


@pytest.mark.distributed
def test_two_ranks_only_one_writes_the_cache(corpus, tmp_path):
    _, prefix = corpus
    work_dir = tmp_path / "work"
    work_dir.mkdir()
    run_distributed(_two_ranks_build, 2, prefix, str(work_dir))
    assert sorted(p for p in os.listdir(work_dir) if p.startswith("built-by")) == ["built-by-rank-0"]
    np.testing.assert_array_equal(np.load(work_dir / "stats-0.npy"), np.load(work_dir / "stats-1.npy"))
    np.testing.assert_array_equal(np.load(work_dir / "samples-0.npy"),
                                  np.load(work_dir / "samples-1.npy"))
    assert len(os.listdir(work_dir / "cache")) == 3  # no temporary files left behind
