"""The compiled helpers: numerics against independent references, and the build-on-first-use lock."""
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import filelock
import numpy as np
import pytest

from megatron.core.data import helpers
from megatron.core.data.helpers import HelpersBuildError, load_helpers

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def reference_sample_idx(sizes, doc_idx, seq_length, num_samples):
    """Row i = where global token i*seq_length lies in the concatenation of doc_idx's documents."""
    ends = np.cumsum(sizes[doc_idx], dtype=np.int64)
    starts = ends - sizes[doc_idx]
    rows = [(0, 0)]
    for i in range(1, num_samples + 1):
        token = i * seq_length
        position = int(np.searchsorted(ends, token, side="right"))
        rows.append((position, token - int(starts[position])))
    return np.array(rows, dtype=np.int64)


@pytest.mark.parametrize("sizes_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("seq_length", [1, 7, 64])
def test_build_sample_idx_matches_reference(sizes_dtype, seq_length):
    rng = np.random.default_rng(seq_length)
    sizes = rng.integers(0, 40, size=50).astype(sizes_dtype)  # includes empty documents
    documents = np.arange(50, dtype=np.int64)
    num_epochs = 3
    doc_idx = np.tile(documents, num_epochs)
    rng.shuffle(doc_idx)
    tokens_per_epoch = int(sizes.sum())
    sample_idx = load_helpers().build_sample_idx(sizes, doc_idx, seq_length, num_epochs,
                                                 tokens_per_epoch)
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    assert sample_idx.dtype == np.int64
    assert sample_idx.shape == (num_samples + 1, 2)
    np.testing.assert_array_equal(sample_idx, reference_sample_idx(sizes, doc_idx, seq_length,
                                                                    num_samples))


def test_build_sample_idx_beyond_int32():
    # Three documents of 2^31 - 1 tokens: offsets and totals exceed int32.
    sizes = np.full(3, 2**31 - 1, dtype=np.int32)
    doc_idx = np.array([2, 0, 1, 1, 2, 0], dtype=np.int64)
    seq_length = 2**28 + 3
    tokens_per_epoch = int(sizes.sum(dtype=np.int64))
    sample_idx = load_helpers().build_sample_idx(sizes, doc_idx, seq_length, 2, tokens_per_epoch)
    num_samples = (2 * tokens_per_epoch - 1) // seq_length
    np.testing.assert_array_equal(sample_idx, reference_sample_idx(sizes, doc_idx, seq_length,
                                                                    num_samples))
    assert sample_idx[:, 1].max() > 2**30


def test_build_sample_idx_rejects_inconsistent_input():
    module = load_helpers()
    sizes = np.array([5, 5], dtype=np.int32)
    with pytest.raises(ValueError, match="ran out of documents"):
        module.build_sample_idx(sizes, np.array([0], dtype=np.int64), 2, 1, 10)
    with pytest.raises(ValueError, match="outside sizes"):
        module.build_sample_idx(sizes, np.array([0, 7], dtype=np.int64), 2, 1, 10)
    with pytest.raises(ValueError, match="seq_length"):
        module.build_sample_idx(sizes, np.array([0, 1], dtype=np.int64), 0, 1, 10)


def reference_blending(weights, size):
    weights = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    counts = [0] * len(weights)
    index, sample = [], []
    for k in range(size):
        errors = [w * max(k, 1) - c for w, c in zip(weights, counts)]
        best = errors.index(max(errors))
        index.append(best)
        sample.append(counts[best])
        counts[best] += 1
    return np.array(index), np.array(sample)


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.7, 0.2, 0.1], [3.0, 1.0, 1e-3, 5.0]])
def test_build_blending_indices_matches_reference(weights):
    size = 2000
    lengths = np.full(len(weights), size, dtype=np.int64)
    dataset_index, dataset_sample_index = load_helpers().build_blending_indices(
        np.array(weights, dtype=np.float64), lengths, size)
    expected_index, expected_sample = reference_blending(weights, size)
    assert dataset_index.dtype == np.int32 and dataset_sample_index.dtype == np.int64
    np.testing.assert_array_equal(dataset_index, expected_index)
    np.testing.assert_array_equal(dataset_sample_index, expected_sample)


def test_build_blending_indices_many_datasets():
    num_datasets = 300  # more than uint8 can index
    weights = np.ones(num_datasets)
    dataset_index, dataset_sample_index = load_helpers().build_blending_indices(
        weights, np.full(num_datasets, 10, dtype=np.int64), 3000)
    assert dataset_index.max() == num_datasets - 1
    np.testing.assert_array_equal(np.bincount(dataset_index), np.full(num_datasets, 10))


def test_build_blending_indices_never_reads_past_a_dataset():
    with pytest.raises(ValueError, match="needs sample 4 of dataset 1, which has only 4 samples"):
        load_helpers().build_blending_indices(np.array([0.5, 0.5]), np.array([100, 4]), 20)


def test_missing_compiler_gives_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(HelpersBuildError, match="no C\\+\\+ compiler found"):
        helpers.find_cxx_compiler()
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(HelpersBuildError, match="CXX='/nonexistent/c\\+\\+'"):
        helpers.find_cxx_compiler()


def _dead_pid():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


class FakeBuild:
    """Stands in for the compiler: writes the target file and counts the builds; loading returns the path."""

    def __init__(self, monkeypatch):
        self.builds = 0
        monkeypatch.setattr(helpers, "build_helpers_extension", self.build)
        monkeypatch.setattr(helpers, "_import_from", lambda path: path)

    def build(self, output_dir):
        self.builds += 1
        target = os.path.join(output_dir, helpers.extension_filename())
        with open(target, "w") as f:
            f.write("library")
        return target


def _lock_path(root):
    return root / helpers.python_tag() / helpers.source_digest() / "build.lock"


def test_lock_file_left_by_a_dead_process_does_not_block(monkeypatch, tmp_path):
    fake = FakeBuild(monkeypatch)
    lock_path = _lock_path(tmp_path)
    lock_path.parent.mkdir(parents=True)
    lock_path.write_text(f"{_dead_pid()} {socket.gethostname()} {time.time()}\n")
    start = time.monotonic()
    target = helpers.build_on_first_use(str(tmp_path), timeout_s=5)
    assert time.monotonic() - start < 2
    assert fake.builds == 1 and open(target).read() == "library"
    assert helpers.build_on_first_use(str(tmp_path), timeout_s=5) == target and fake.builds == 1


def test_held_lock_times_out_instead_of_hanging(monkeypatch, tmp_path):
    fake = FakeBuild(monkeypatch)
    lock_path = _lock_path(tmp_path)
    lock_path.parent.mkdir(parents=True)
    with filelock.FileLock(str(lock_path)):
        with pytest.raises(HelpersBuildError, match="timed out after 0.3 s .*build.lock"):
            helpers.build_on_first_use(str(tmp_path), timeout_s=0.3)
    assert fake.builds == 0


def test_waiting_process_loads_the_owner_build(monkeypatch, tmp_path):
    """The lock's owner builds while we wait; once it releases, we load its library without building."""
    fake = FakeBuild(monkeypatch)
    lock_path = _lock_path(tmp_path)
    lock_path.parent.mkdir(parents=True)
    owner = filelock.FileLock(str(lock_path), thread_local=False)
    owner.acquire()

    def owner_builds_then_releases():
        time.sleep(0.3)
        fake.build(str(lock_path.parent))
        owner.release()

    thread = threading.Thread(target=owner_builds_then_releases)
    thread.start()
    target = helpers.build_on_first_use(str(tmp_path), timeout_s=10)
    thread.join()
    assert fake.builds == 1 and open(target).read() == "library"


_RACER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    import numpy as np
    from megatron.core.data.helpers import build_on_first_use
    module = build_on_first_use({root!r}, timeout_s=120)
    out = module.build_blending_indices(np.array([1.0, 1.0]), np.array([2, 2]), 4)
    print(module.__file__, out[0].tolist())
""")


@pytest.mark.slow
def test_two_processes_build_once_despite_a_stale_lock(tmp_path):
    """Two racing processes over a lock file a crashed build left: one compiles (logged by a CXX wrapper),
    both load the module."""
    root = tmp_path / "build"
    build_dir = root / helpers.python_tag() / helpers.source_digest()
    build_dir.mkdir(parents=True)
    (build_dir / "build.lock").write_text(f"{_dead_pid()} {socket.gethostname()} {time.time()}\n")
    log = tmp_path / "compiler.log"
    wrapper = tmp_path / "cxx-wrapper"
    wrapper.write_text(f"#!/bin/sh\necho $$ >> {log}\nexec {helpers.find_cxx_compiler()[0]} \"$@\"\n")
    wrapper.chmod(0o755)
    env = dict(os.environ, CXX=str(wrapper))
    code = _RACER.format(repo=REPO_ROOT, root=str(root))
    racers = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [r.communicate(timeout=300) for r in racers]
    for racer, (stdout, stderr) in zip(racers, outputs):
        assert racer.returncode == 0, stderr
        assert stdout.split()[0] == str(build_dir / helpers.extension_filename())
        assert stdout.strip().endswith("[0, 1, 0, 1]")
    assert len(log.read_text().split()) == 1
