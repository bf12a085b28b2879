"""GPT pretraining dataset: documents packed into fixed-length samples through cached indices.

Given the documents D of a split (ids into an indexed dataset whose item d has ``sizes[d]``
tokens), a sequence length s and a number of samples n:

    T = sum_{d in D} sizes[d]                 tokens per epoch
    E = min{E >= 1 : (E*T - 1) // s >= n}     epochs needed
    N = (E*T - 1) // s                        samples built (N >= n)

* ``doc_idx`` (int64, E*|D|): D repeated E times and shuffled with ``RandomState(seed)``, all
  epochs together, except that a last epoch needing fewer than 80 % of an epoch's samples
  (``separate_last_epoch``) is shuffled on its own and appended (Megatron's rule).
* ``sample_idx`` (int64, [N + 1, 2]): row i = (position in doc_idx, token offset) where sample i
  starts in the concatenation of the documents in doc_idx order. Sample i runs from row i to row
  i + 1 *inclusive*, so it holds s + 1 tokens and consecutive samples share one token (inputs are
  text[:-1], labels text[1:]). No padding and no EOD is inserted between documents.
* ``shuffle_idx`` (int64, N): a permutation of [0, N) from the same generator (the first E-1
  epochs' samples and the last epoch's shuffled separately when separate_last_epoch).

The three arrays are cached as ``.npy`` files whose names carry everything they depend on:
``{prefix}_{name}_indexmap_{n}ns_{s}sl_{seed}s_{fingerprint}_{doc,sample,shuffle}_idx.npy``,
where the fingerprint hashes the split's document ids and their sizes, so a changed dataset
never reuses a stale index. One rank builds them; the others wait, then all memory-map them.
"""
import hashlib
import logging
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megatron.core.data.data_paths import (DEFAULT_SPLIT, DatasetGroup, WeightedPrefix,
                                           parse_split)
from megatron.core.data.helpers import load_helpers
from megatron.core.data.indexed_dataset import IndexedDatasetError, data_file_path

logger = logging.getLogger(__name__)

INDEX_KINDS = ("doc_idx", "sample_idx", "shuffle_idx")
SEPARATE_LAST_EPOCH_FRACTION = 0.80
# Bump when index construction changes, so caches built by older code are not reused.
_INDEX_FORMAT_SALT = b"megatron-gpt-index-v1"


class DatasetConfigError(ValueError):
    """Invalid dataset configuration or arguments; the message names the field and the value."""


class IndexCacheError(RuntimeError):
    """The index cache cannot be written or read (location, permissions, a failed build)."""


@dataclass(frozen=True)
class GPTDatasetConfig:
    """Everything needed to build the train/valid/test GPT datasets.

    Option 1: ``data_path`` (weighted prefixes, blended) split by ``split`` proportions.
    Option 2: ``train_groups`` (exactly one) and optional ``valid_groups``/``test_groups``, each
    a named blend of document ranges. ``data_cache_path``: where index caches go (default: next
    to each dataset's files). ``mmap_warmup`` reads the files once at open. ``vocab_size``: the
    tokenizer's vocabulary; given, every sample read is checked to hold ids in [0, vocab_size).
    """

    seq_length: int
    seed: int
    data_path: tuple[WeightedPrefix, ...] = ()
    split: tuple[float, float, float] = parse_split(DEFAULT_SPLIT)
    train_groups: tuple[DatasetGroup, ...] = ()
    valid_groups: tuple[DatasetGroup, ...] = ()
    test_groups: tuple[DatasetGroup, ...] = ()
    data_impl: str = "mmap"
    mmap_warmup: bool = False
    data_cache_path: str | None = None
    vocab_size: int | None = None

    def __post_init__(self):
        _check_positive_int("seq_length", self.seq_length)
        if self.vocab_size is not None:
            _check_positive_int("vocab_size", self.vocab_size)
        _check_seed(self.seed)
        option2 = self.train_groups or self.valid_groups or self.test_groups
        if self.data_path and option2:
            raise DatasetConfigError(
                "data_path (--data-path) and weighted split paths (--*-weighted-split-paths) "
                "are exclusive; give one of them")
        if not self.data_path and not option2:
            raise DatasetConfigError(
                "no data: give data_path (--data-path) or train_groups "
                "(--train-weighted-split-paths)")
        if option2 and len(self.train_groups) != 1:
            raise DatasetConfigError(
                f"train_groups (--train-weighted-split-paths) needs exactly one group, "
                f"got {len(self.train_groups)}")
        if len(self.split) != 3 or any(f < 0 for f in self.split) or sum(self.split) <= 0:
            raise DatasetConfigError(f"split must be 3 non-negative proportions, got {self.split}")

    def prefixes(self) -> list[tuple[str, str]]:
        """(flag, prefix) of every dataset the config reads, in flag order."""
        found = [("--data-path", entry.prefix) for entry in self.data_path]
        for split, groups in (("train", self.train_groups), ("valid", self.valid_groups),
                              ("test", self.test_groups)):
            found += [(f"--{split}-weighted-split-paths", entry.prefix)
                      for group in groups for entry in group.entries]
        return found


def _check_positive_int(field, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise DatasetConfigError(f"{field} must be a positive integer, got {value!r}")


def _check_seed(seed):
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise DatasetConfigError(f"seed must be an integer in [0, 2**32), got {seed!r}")


def num_epochs_needed(tokens_per_epoch, seq_length, num_samples):
    """Smallest E >= 1 with (E*T - 1) // s >= n, i.e. E = ceil((n*s + 1) / T)."""
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def _shuffled_doc_idx(documents, num_epochs, rng, separate_last_epoch):
    if separate_last_epoch:
        first = _shuffled_doc_idx(documents, num_epochs - 1, rng, False)
        last = _shuffled_doc_idx(documents, 1, rng, False)
        return np.concatenate((first, last))
    doc_idx = np.tile(documents, num_epochs)  # [E * |D|], epoch-major as Megatron's mgrid
    rng.shuffle(doc_idx)
    return doc_idx


def _shuffled_sample_order(num_first, total, rng):
    first = np.arange(num_first, dtype=np.int64)
    rng.shuffle(first)
    if num_first == total:
        return first
    last = np.arange(num_first, total, dtype=np.int64)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_index_arrays(sizes, documents, num_samples, seq_length, seed):
    """Build (doc_idx, sample_idx, shuffle_idx) for `documents` (see the module docstring).

    ``sizes``: tokens per item of the whole indexed dataset; ``documents``: int64 item ids.
    """
    documents = np.ascontiguousarray(documents, dtype=np.int64)
    if sizes.dtype not in (np.int32, np.int64):
        sizes = sizes.astype(np.int64)
    sizes = np.ascontiguousarray(sizes)
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    if tokens_per_epoch <= 0:
        raise DatasetConfigError(f"the {len(documents)} documents of the split hold no tokens")
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    samples_before_last_epoch = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    separate_last_epoch = num_epochs > 1 and (
        num_samples - samples_before_last_epoch
        < int(SEPARATE_LAST_EPOCH_FRACTION * samples_per_epoch))
    rng = np.random.RandomState(seed)
    doc_idx = _shuffled_doc_idx(documents, num_epochs, rng, separate_last_epoch)
    sample_idx = load_helpers().build_sample_idx(sizes, doc_idx, seq_length, num_epochs,
                                                 tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    num_first = samples_before_last_epoch if separate_last_epoch else total
    shuffle_idx = _shuffled_sample_order(num_first, total, rng)
    logger.info("built indices: %d documents, %d tokens/epoch, %d epochs (separate last: %s), "
                "%d samples", len(documents), tokens_per_epoch, num_epochs, separate_last_epoch,
                total)
    return doc_idx, sample_idx, shuffle_idx


def dataset_fingerprint(sizes, documents):
    """Short hash of the document ids and their sizes: all the indices depend on from the data."""
    documents = np.ascontiguousarray(documents, dtype=np.int64)
    digest = hashlib.blake2b(_INDEX_FORMAT_SALT, digest_size=8)
    digest.update(documents.tobytes())
    digest.update(np.ascontiguousarray(sizes[documents], dtype=np.int64).tobytes())
    return digest.hexdigest()


def _save_atomically(path, array):
    partial = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"
    try:
        with open(partial, "wb") as f:
            np.save(f, np.ascontiguousarray(array))
        os.replace(partial, path)
    except OSError:
        if os.path.exists(partial):
            os.remove(partial)
        raise


def _distributed_context(group):
    """(is_distributed, is_builder, global rank of the builder) for the cache-building group."""
    # A process group can only exist if torch.distributed was imported; avoid importing torch.
    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return False, True, 0
    builder = 0 if group is None else dist.get_global_rank(group, 0)
    return True, dist.get_rank() == builder, builder


def _write_cache(paths, build):
    directory = os.path.dirname(os.path.abspath(next(iter(paths.values()))))
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise IndexCacheError(
            f"cannot write the index cache in {directory} ({exc.strerror or exc}); give a "
            f"writable directory as data_cache_path (--data-cache-path)") from exc
    arrays = build()
    written = []
    try:
        for kind, path in paths.items():
            _save_atomically(path, arrays[kind])
            written.append(path)
    except OSError as exc:
        for path in written:  # a cache is whole or absent
            os.remove(path)
        raise IndexCacheError(f"cannot write the index cache {exc.filename or path} "
                              f"({exc.strerror or exc}); free space there or give another directory "
                              f"as data_cache_path (--data-cache-path)") from exc


def load_or_build_cached_arrays(paths: dict[str, str], build: Callable[[], dict[str, np.ndarray]],
                                group=None) -> dict[str, np.ndarray]:
    """Memory-map the arrays cached at `paths` ({kind: .npy path}), building them if missing.

    Without torch.distributed the caller builds. With it, every rank of `group` (default: the
    world) must call this: the group's first rank builds (each file written under a temporary
    name, then renamed), the others wait on a broadcast of its outcome, so a failed build raises
    on every rank instead of hanging them. The cache must be on a filesystem shared by the group.
    """
    is_distributed, is_builder, builder = _distributed_context(group)
    failure = None
    if is_builder and not all(os.path.isfile(p) for p in paths.values()):
        start = time.perf_counter()
        try:
            _write_cache(paths, build)
        except Exception as exc:
            if not is_distributed:
                raise
            failure = (exc, f"{type(exc).__name__}: {exc}")
        else:
            logger.info("wrote %s in %.2f s", ", ".join(paths.values()), time.perf_counter() - start)
    if is_distributed:
        dist = sys.modules["torch.distributed"]
        status = [None if failure is None else failure[1]]
        dist.broadcast_object_list(status, src=builder, group=group)
        if failure is not None:
            raise failure[0]
        if status[0] is not None:
            raise IndexCacheError(f"rank {builder} failed to build the index cache: {status[0]}")
    missing = [p for p in paths.values() if not os.path.isfile(p)]
    if missing:
        raise IndexCacheError(
            f"index cache files not found after the build: {missing}; the cache directory must "
            f"be shared by all ranks (set data_cache_path / --data-cache-path)")
    return {kind: np.load(path, mmap_mode="r") for kind, path in paths.items()}


def index_cache_paths(data_prefix, name, num_samples, seq_length, seed, fingerprint,
                      cache_dir=None):
    """{kind: path} of the cached indices, next to the data or under `cache_dir`."""
    base = data_prefix if cache_dir is None else os.path.join(cache_dir, os.path.basename(data_prefix))
    stem = f"{base}_{name}_indexmap_{num_samples}ns_{seq_length}sl_{seed}s_{fingerprint}"
    return {kind: f"{stem}_{kind}.npy" for kind in INDEX_KINDS}


class MappedIndexArrays:
    """Pickled without its index arrays (the attributes named by ``MAPPED_KINDS``) when they were read
    from the cache files ``cache_paths``: the copy (a DataLoader worker's) maps those files again instead
    of receiving the arrays' contents."""

    MAPPED_KINDS: tuple[str, ...] = ()

    def __getstate__(self):
        if getattr(self, "cache_paths", None) is None:
            return dict(self.__dict__)
        return {k: v for k, v in self.__dict__.items() if k not in self.MAPPED_KINDS}

    def __setstate__(self, state):
        self.__dict__.update(state)
        if getattr(self, "cache_paths", None) is not None:
            for kind in self.MAPPED_KINDS:
                setattr(self, kind, np.load(self.cache_paths[kind], mmap_mode="r"))


class GPTDataset(MappedIndexArrays):
    """Samples of ``seq_length + 1`` tokens packed from `documents` of `indexed_dataset`.

    ``dataset[i] == {"text": int64[seq_length + 1]}``; ``len(dataset) = N >= num_samples`` (whole
    epochs' worth, see the module docstring). `indexed_dataset` needs only ``sizes``,
    ``get(i, offset, length)`` and ``len()``. `data_prefix` names the cache files (placed next
    to it unless `cache_dir` is given); `group`: the ranks that build the dataset together.
    Given `vocab_size`, a sample holding an id outside [0, vocab_size) raises IndexedDatasetError
    naming the ``.bin`` and the item (a min and a max over the s + 1 ids: microseconds a sample).
    """

    MAPPED_KINDS = INDEX_KINDS

    def __init__(self, name, data_prefix, indexed_dataset, documents, num_samples, seq_length,
                 seed, cache_dir=None, group=None, vocab_size=None):
        documents = np.asarray(documents, dtype=np.int64)
        _check_positive_int("seq_length", seq_length)
        _check_seed(seed)
        if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) \
                or num_samples < 0:
            raise DatasetConfigError(f"{name}: num_samples must be >= 0, got {num_samples!r}")
        if documents.ndim != 1 or documents.size == 0:
            raise DatasetConfigError(f"{name}: documents must be a non-empty 1-D array of ids")
        if documents.min() < 0 or documents.max() >= len(indexed_dataset):
            raise DatasetConfigError(
                f"{name}: document ids must lie in [0, {len(indexed_dataset)}), got "
                f"[{documents.min()}, {documents.max()}]")
        self.name = name
        self.data_prefix = data_prefix
        self.indexed_dataset = indexed_dataset
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        sizes = indexed_dataset.sizes
        fingerprint = dataset_fingerprint(sizes, documents)
        self.cache_paths = index_cache_paths(data_prefix, name, num_samples, seq_length, seed,
                                             fingerprint, cache_dir)
        arrays = load_or_build_cached_arrays(
            self.cache_paths,
            lambda: dict(zip(INDEX_KINDS, build_index_arrays(sizes, documents, num_samples,
                                                             seq_length, seed))),
            group)
        self.doc_idx = arrays["doc_idx"]
        self.sample_idx = arrays["sample_idx"]
        self.shuffle_idx = arrays["shuffle_idx"]

    def __len__(self):
        return self.shuffle_idx.shape[0]

    def __getitem__(self, idx):
        if not 0 <= idx < len(self):
            raise IndexError(f"{self.name}: sample {idx} out of range for {len(self)} samples")
        sample = int(self.shuffle_idx[idx])
        first_doc, first_offset = (int(v) for v in self.sample_idx[sample])
        last_doc, last_offset = (int(v) for v in self.sample_idx[sample + 1])
        get = self.indexed_dataset.get
        if first_doc == last_doc:
            tokens = get(int(self.doc_idx[first_doc]), offset=first_offset,
                         length=last_offset - first_offset + 1)
            text = np.array(tokens, dtype=np.int64)
        else:
            pieces = [get(int(self.doc_idx[first_doc]), offset=first_offset)]
            pieces += [get(int(self.doc_idx[i])) for i in range(first_doc + 1, last_doc)]
            pieces.append(get(int(self.doc_idx[last_doc]), length=last_offset + 1))
            text = np.concatenate(pieces).astype(np.int64, copy=False)
        if self.vocab_size is not None:
            self._check_ids(idx, text, first_doc, last_doc)
        return {"text": text}

    def _check_ids(self, idx, text, first_doc, last_doc):
        """Raise IndexedDatasetError naming the .bin and the item if ``text`` holds an id outside
        [0, vocab_size)."""
        if text.size == 0 or (text.min() >= 0 and text.max() < self.vocab_size):
            return
        items = [int(self.doc_idx[i]) for i in range(first_doc, last_doc + 1)]
        bad = [item for item in items
               if ((ids := self.indexed_dataset.get(item)) < 0).any() or (ids >= self.vocab_size).any()]
        raise IndexedDatasetError(
            f"{data_file_path(self.data_prefix)}: sample {idx} of the {self.name} data holds token ids in "
            f"[{int(text.min())}, {int(text.max())}], outside the tokenizer's vocabulary [0, {self.vocab_size}) "
            f"(item {bad[0] if bad else items[0]}): the dataset is damaged or was tokenized with another tokenizer")
