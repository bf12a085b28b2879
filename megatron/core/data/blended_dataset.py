"""Weighted blend of several datasets, with its indices cached on disk.

With normalised weights w_d and counts c_d(k) of the samples taken from dataset d before blended
sample k, sample k comes from

    d_k = argmax_d  w_d * max(k, 1) - c_d(k)      (greedy deficit, first d on ties)

and is that dataset's sample c_{d_k}(k). Every prefix of the blend therefore follows the weights
to within about one sample per dataset. The blend has exactly `size` samples; a child must have
at least about ``w_d * size + 1`` samples (builders ask for ``ceil(size * w_d * 1.005)``), and
reading past a child's end is detected and raised, never wrapped around.
"""
import hashlib
import math
import os

import numpy as np

from megatron.core.data.gpt_dataset import DatasetConfigError, MappedIndexArrays, load_or_build_cached_arrays
from megatron.core.data.helpers import load_helpers

BLEND_KINDS = ("dataset_index", "dataset_sample_index")
_BLEND_FORMAT_SALT = b"megatron-blend-index-v1"


def normalized_weights(weights):
    """Weights as float64 summing to 1; each must be positive and finite."""
    values = np.asarray(weights, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise DatasetConfigError(f"blending needs a non-empty list of weights, got {weights!r}")
    if not all(math.isfinite(w) and w > 0 for w in values):
        raise DatasetConfigError(f"blending weights must be positive and finite, got {list(weights)}")
    return values / values.sum()


def build_blending_indices(weights, dataset_lengths, size):
    """(dataset_index int32[size], dataset_sample_index int64[size]) by greedy deficit."""
    return load_helpers().build_blending_indices(
        normalized_weights(weights), np.asarray(dataset_lengths, dtype=np.int64), int(size))


def _describe(dataset):
    prefix = getattr(dataset, "data_prefix", None)
    label = f"{prefix} ({getattr(dataset, 'name', '')})" if prefix else type(dataset).__name__
    return f"{label}: {len(dataset)} samples"


class BlendedDataset(MappedIndexArrays):
    """`size` samples drawn from `datasets` in proportion to `weights` (see the module docstring).

    ``blend[k] == datasets[dataset_index[k]][dataset_sample_index[k]]``. With `cache_dir`, the
    indices are cached there as ``blended_{name}_{size}ns_{hash}_{kind}.npy`` (the hash covers
    the weights and the children's lengths, all the indices depend on) and built once by the
    first rank of `group`; without it they are built in memory.
    """

    MAPPED_KINDS = BLEND_KINDS

    def __init__(self, datasets, weights, size, name="blend", cache_dir=None, group=None):
        if len(datasets) != len(weights):
            raise DatasetConfigError(
                f"{name}: {len(datasets)} datasets but {len(weights)} weights")
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
            raise DatasetConfigError(f"{name}: size must be a non-negative integer, got {size!r}")
        self.name = name
        self.datasets = list(datasets)
        self.weights = normalized_weights(weights)
        self.size = int(size)
        lengths = np.array([len(d) for d in self.datasets], dtype=np.int64)

        def build():
            try:
                indices = build_blending_indices(self.weights, lengths, self.size)
            except ValueError as exc:
                children = "; ".join(f"[{i}] {_describe(d)}" for i, d in enumerate(self.datasets))
                raise DatasetConfigError(
                    f"{name}: cannot blend {self.size} samples with weights "
                    f"{self.weights.round(6).tolist()}: {exc} (datasets: {children})") from None
            return dict(zip(BLEND_KINDS, indices))

        if cache_dir is None:
            arrays = build()
        else:
            digest = hashlib.blake2b(_BLEND_FORMAT_SALT, digest_size=8)
            digest.update(self.weights.tobytes())
            digest.update(lengths.tobytes())
            stem = os.path.join(cache_dir, f"blended_{name}_{self.size}ns_{digest.hexdigest()}")
            self.cache_paths = {kind: f"{stem}_{kind}.npy" for kind in BLEND_KINDS}
            arrays = load_or_build_cached_arrays(self.cache_paths, build, group)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]

    def __len__(self):
        return self.size

    def __getitem__(self, idx):
        if not 0 <= idx < self.size:
            raise IndexError(f"{self.name}: sample {idx} out of range for {self.size} samples")
        dataset = int(self.dataset_index[idx])
        return self.datasets[dataset][int(self.dataset_sample_index[idx])]
