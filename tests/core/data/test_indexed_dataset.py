"""The mmap indexed dataset against its documented byte layout, and its error handling."""
import os
import pickle
import re
import struct

import numpy as np
import pytest

from megatron.core.data.indexed_dataset import (
    IndexedDatasetBuilder,
    IndexedDatasetError,
    MMapIndexedDataset,
    _write_index,
    best_fitting_dtype,
    check_dataset_prefix,
    check_vocabulary,
    data_file_path,
    index_file_path,
    make_dataset,
    make_output_directory,
)
from tests.disk_faults import full_disk, read_only

# Three documents in uint16 (code 8): doc 0 = item [1, 2, 3]; doc 1 = items [4, 5] and [6];
# doc 2 = item [7]. Written by hand from the .idx layout: magic, version, dtype code, item and
# document counts, int32 sizes, int64 byte pointers, int64 document index.
THREE_DOC_IDX_HEX = (
    "4d4d4944494458 0000"          # magic MMIDIDX\0\0
    "0100000000000000"             # version 1
    "08"                           # dtype code 8 = uint16
    "0400000000000000"             # len = 4 items
    "0400000000000000"             # doc_count = 4 (3 documents + 1)
    "03000000 02000000 01000000 01000000"  # sizes int32
    "0000000000000000 0600000000000000 0a00000000000000 0c00000000000000"  # byte pointers int64
    "0000000000000000 0100000000000000 0300000000000000 0400000000000000"  # doc_idx int64
)
THREE_DOC_BIN_HEX = "0100 0200 0300 0400 0500 0600 0700"


def _build(prefix, documents, dtype=np.uint16):
    """Write ``documents`` (lists of items) with add_item/end_document."""
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=dtype)
    for document in documents:
        for item in document:
            builder.add_item(item)
        builder.end_document()
    builder.finalize(index_file_path(prefix))


def _random_documents(rng, count, vocab):
    return [[rng.integers(0, vocab, size=rng.integers(0, 20)) for _ in range(rng.integers(1, 4))]
            for _ in range(count)]


@pytest.fixture
def three_doc_prefix(tmp_path):
    prefix = str(tmp_path / "three")
    _build(prefix, [[[1, 2, 3]], [[4, 5], [6]], [[7]]])
    return prefix


def test_writer_matches_hand_written_hex_dump(three_doc_prefix):
    with open(index_file_path(three_doc_prefix), "rb") as f:
        assert f.read() == bytes.fromhex(THREE_DOC_IDX_HEX)
    with open(data_file_path(three_doc_prefix), "rb") as f:
        assert f.read() == bytes.fromhex(THREE_DOC_BIN_HEX)


def test_reader_parses_hand_written_files(tmp_path):
    prefix = str(tmp_path / "handmade")
    with open(index_file_path(prefix), "wb") as f:
        f.write(bytes.fromhex(THREE_DOC_IDX_HEX))
    with open(data_file_path(prefix), "wb") as f:
        f.write(bytes.fromhex(THREE_DOC_BIN_HEX))
    ds = MMapIndexedDataset(prefix)
    assert len(ds) == 4 and ds.dtype == np.uint16
    assert [ds[i].tolist() for i in range(4)] == [[1, 2, 3], [4, 5], [6], [7]]
    assert ds.sizes.tolist() == [3, 2, 1, 1]
    assert ds.pointers.tolist() == [0, 6, 10, 12]
    assert ds.doc_idx.tolist() == [0, 1, 3, 4]
    assert ds.sizes.dtype == np.int32 and ds.pointers.dtype == np.int64 and ds.doc_idx.dtype == np.int64


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16, np.float64])
def test_round_trip_every_dtype(tmp_path, dtype):
    rng = np.random.default_rng(0)
    documents = _random_documents(rng, 30, 100)
    prefix = str(tmp_path / "rt")
    _build(prefix, documents, dtype=dtype)
    ds = make_dataset(prefix, impl="infer")
    items = [item for document in documents for item in document]
    assert len(ds) == len(items) and ds.dtype == np.dtype(dtype)
    for i, item in enumerate(items):
        np.testing.assert_array_equal(ds[i], np.asarray(item, dtype=dtype))
    expected_doc_idx = np.concatenate([[0], np.cumsum([len(d) for d in documents])])
    np.testing.assert_array_equal(ds.doc_idx, expected_doc_idx)
    expected_pointers = np.concatenate([[0], np.cumsum([len(i) for i in items])[:-1]]) * np.dtype(dtype).itemsize
    np.testing.assert_array_equal(ds.pointers, expected_pointers)


def test_float64_is_written_with_code_7_and_code_6_reads_as_float64(tmp_path):
    prefix = str(tmp_path / "floats")
    _build(prefix, [[[0.5, 1.5]]], dtype=np.float64)
    with open(index_file_path(prefix), "rb") as f:
        raw = bytearray(f.read())
    assert raw[17] == 7
    raw[17] = 6
    with open(index_file_path(prefix), "wb") as f:
        f.write(raw)
    assert MMapIndexedDataset(prefix)[0].tolist() == [0.5, 1.5]


def test_get_is_a_zero_copy_view(three_doc_prefix):
    ds = MMapIndexedDataset(three_doc_prefix)
    part = ds.get(1, offset=1, length=1)
    assert part.tolist() == [5]
    assert ds.get(0, offset=1).tolist() == [2, 3]
    assert ds.get(0, offset=3, length=0).tolist() == []
    assert not part.flags.owndata and not part.flags.writeable
    assert np.shares_memory(part, ds.get(1))
    assert [a.tolist() for a in ds[1:3]] == [[4, 5], [6]]
    assert ds[-1].tolist() == [7]
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)
    with pytest.raises(IndexError):
        ds[4]


def test_best_fitting_dtype():
    assert best_fitting_dtype(50257) == np.uint16
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(250880) == np.int32


def test_path_helpers_and_exists(three_doc_prefix):
    assert data_file_path("a/b") == "a/b.bin" and index_file_path("a/b") == "a/b.idx"
    assert MMapIndexedDataset.exists(three_doc_prefix)
    assert not MMapIndexedDataset.exists(three_doc_prefix + "_missing")


def test_pickle_reopens_by_prefix(three_doc_prefix):
    ds = MMapIndexedDataset(three_doc_prefix, skip_warmup=False)
    state = pickle.dumps(ds)
    assert len(state) < 500
    again = pickle.loads(state)
    assert [again[i].tolist() for i in range(len(again))] == [ds[i].tolist() for i in range(len(ds))]


def test_empty_dataset(tmp_path):
    prefix = str(tmp_path / "empty")
    _build(prefix, [])
    ds = MMapIndexedDataset(prefix)
    assert len(ds) == 0 and ds.doc_idx.tolist() == [0]
    assert os.path.getsize(data_file_path(prefix)) == 0


def test_add_document_and_add_documents_equal_item_by_item(tmp_path):
    rng = np.random.default_rng(1)
    documents = _random_documents(rng, 20, 1000)
    _build(str(tmp_path / "items"), documents)
    one_by_one = IndexedDatasetBuilder(str(tmp_path / "doc.bin"), dtype=np.uint16)
    for document in documents:
        one_by_one.add_document(np.concatenate(document), [len(item) for item in document])
    one_by_one.finalize(str(tmp_path / "doc.idx"))
    bulk = IndexedDatasetBuilder(str(tmp_path / "bulk.bin"), dtype=np.uint16)
    items = [item for document in documents for item in document]
    bulk.add_documents(np.concatenate(items), [len(i) for i in items], [len(d) for d in documents])
    bulk.finalize(str(tmp_path / "bulk.idx"))
    for name in ("doc", "bulk"):
        for ext in ("bin", "idx"):
            with open(tmp_path / f"items.{ext}", "rb") as a, open(tmp_path / f"{name}.{ext}", "rb") as b:
                assert a.read() == b.read(), (name, ext)


def test_rejects_token_ids_that_do_not_fit(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    with pytest.raises(IndexedDatasetError, match="does not fit in uint16"):
        builder.add_item(np.array([1, 70000]))
    with pytest.raises(IndexedDatasetError, match="x.bin"):
        builder.add_item(np.array([-1]))
    builder.abort()
    with pytest.raises(IndexedDatasetError, match="float32"):
        IndexedDatasetBuilder(str(tmp_path / "y.bin"), dtype=np.float32)


def test_unfinished_builder_leaves_no_dataset(tmp_path):
    prefix = str(tmp_path / "partial")
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.uint16)
    builder.add_item([1, 2, 3])
    builder.end_document()
    assert not os.path.exists(data_file_path(prefix)) and not MMapIndexedDataset.exists(prefix)
    assert all(name.endswith(".tmp") for name in os.listdir(tmp_path))
    builder.abort()
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(data_file_path(prefix), dtype=np.uint16) as failing:
            failing.add_item([1])
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []


def test_finalize_replaces_a_previous_dataset(tmp_path, three_doc_prefix):
    _build(three_doc_prefix, [[[9, 9]]])
    ds = MMapIndexedDataset(three_doc_prefix)
    assert len(ds) == 1 and ds[0].tolist() == [9, 9]
    assert sorted(os.listdir(tmp_path)) == ["three.bin", "three.idx"]


def test_finalize_closes_an_open_document(tmp_path):
    prefix = str(tmp_path / "open")
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype=np.uint16)
    builder.add_item([1])
    builder.end_document()
    builder.add_item([2])
    builder.add_item([3])
    builder.finalize(index_file_path(prefix))
    assert MMapIndexedDataset(prefix).doc_idx.tolist() == [0, 1, 3]


def test_merge_equals_building_everything_at_once(tmp_path):
    rng = np.random.default_rng(2)
    parts = [_random_documents(rng, n, 500) for n in (5, 0, 7)]
    for k, documents in enumerate(parts):
        _build(str(tmp_path / f"part{k}"), documents)
    _build(str(tmp_path / "whole"), [d for documents in parts for d in documents])
    builder = IndexedDatasetBuilder(str(tmp_path / "merged.bin"), dtype=np.uint16)
    for k in range(len(parts)):
        builder.merge_file_(str(tmp_path / f"part{k}"))
    builder.finalize(str(tmp_path / "merged.idx"))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"whole.{ext}").read_bytes() == (tmp_path / f"merged.{ext}").read_bytes()


def test_merge_rejects_dtype_mismatch_and_open_document(tmp_path, three_doc_prefix):
    _build(str(tmp_path / "wide"), [[[1]]], dtype=np.int32)
    builder = IndexedDatasetBuilder(str(tmp_path / "out.bin"), dtype=np.uint16)
    with pytest.raises(IndexedDatasetError, match=r"wide\.bin.*int32.*out\.bin.*uint16"):
        builder.merge_file_(str(tmp_path / "wide"))
    builder.add_item([1])
    with pytest.raises(IndexedDatasetError, match="end_document"):
        builder.merge_file_(three_doc_prefix)
    builder.abort()


def test_pointers_are_64_bit_past_4_gib(tmp_path):
    # Three items of 2^30 int32 tokens put the last pointer at 12 GiB; the .bin is a sparse file.
    prefix = str(tmp_path / "huge")
    sizes = [2 ** 30, 2 ** 30, 2 ** 30, 5]
    _write_index(index_file_path(prefix), np.int32, sizes, [0, 2, 4])
    total_bytes = sum(sizes) * 4
    with open(data_file_path(prefix), "wb") as f:
        f.seek(total_bytes - 20)
        f.write(np.arange(5, dtype=np.int32).tobytes())
    ds = MMapIndexedDataset(prefix)
    assert ds.pointers.tolist() == [0, 2 ** 32, 2 ** 33, 3 * 2 ** 32]
    assert ds.get(3).tolist() == [0, 1, 2, 3, 4]
    assert ds.get(2, offset=2 ** 30 - 1).tolist() == [0]


def test_make_dataset_impls(three_doc_prefix):
    assert len(make_dataset(three_doc_prefix, "mmap")) == 4
    assert len(make_dataset(three_doc_prefix, "infer")) == 4
    for impl in ("cached", "lazy"):
        with pytest.raises(IndexedDatasetError, match="--dataset-impl mmap"):
            make_dataset(three_doc_prefix, impl)
    with pytest.raises(IndexedDatasetError, match="unknown dataset impl"):
        make_dataset(three_doc_prefix, "fancy")


def _rewrite(path, mutate):
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    raw = mutate(raw)
    with open(path, "wb") as f:
        f.write(raw)


def _set(offset, fmt, value):
    def mutate(raw):
        struct.pack_into(fmt, raw, offset, value)
        return raw
    return mutate


SIZES_OFFSET, DOC_IDX_OFFSET = 34, 34 + 12 * 4

CORRUPTIONS = {
    "bad magic": ("idx", lambda raw: b"XXIDIDX\x00\x00" + raw[9:], "bad magic"),
    "legacy magic": ("idx", lambda raw: b"TNTIDX\x00\x00" + raw[8:], "--dataset-impl mmap"),
    "version 2": ("idx", _set(9, "<Q", 2), "unsupported index version 2"),
    "dtype code 9": ("idx", _set(17, "<B", 9), "unknown dtype code 9"),
    "dtype code 0": ("idx", _set(17, "<B", 0), "unknown dtype code 0"),
    "truncated idx": ("idx", lambda raw: raw[:-3], "truncated index"),
    "truncated header": ("idx", lambda raw: raw[:20], "truncated index"),
    "empty idx": ("idx", lambda raw: b"", "truncated index"),
    "idx trailing bytes": ("idx", lambda raw: raw + b"\x00", "trailing bytes"),
    "len too large": ("idx", _set(18, "<Q", 5), "truncated index"),
    "doc_idx last != len": ("idx", _set(DOC_IDX_OFFSET + 24, "<q", 3), "inconsistent document index"),
    "doc_idx first != 0": ("idx", _set(DOC_IDX_OFFSET, "<q", 1), "inconsistent document index"),
    "doc_idx decreasing": ("idx", _set(DOC_IDX_OFFSET + 8, "<q", 4), "offsets decrease"),
    "size larger than bin": ("idx", _set(SIZES_OFFSET, "<i", 4), "data file has 14 bytes but"),
    "truncated bin": ("bin", lambda raw: raw[:-2], "data file has 12 bytes but"),
    "extended bin": ("bin", lambda raw: raw + b"\x00\x00", "data file has 16 bytes but"),
    "bad pointer": ("idx", _set(SIZES_OFFSET + 16 + 24, "<q", 14), "pointers are inconsistent"),
    "shifted middle pointer": ("idx", _set(SIZES_OFFSET + 16 + 8, "<q", 8), r"item 1 starts at byte 8, its sizes put "
                                                                            r"it at 6 \(1 items misplaced\)"),
    "negative size": ("idx", _set(SIZES_OFFSET + 4, "<i", -2), "item 1 has a negative size -2"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupt_files_raise_errors_naming_the_file(three_doc_prefix, name):
    which, mutate, message = CORRUPTIONS[name]
    path = index_file_path(three_doc_prefix) if which == "idx" else data_file_path(three_doc_prefix)
    _rewrite(path, mutate)
    with pytest.raises(IndexedDatasetError, match=message) as error:
        MMapIndexedDataset(three_doc_prefix)
    assert path in str(error.value)
    assert isinstance(error.value, ValueError)


def test_missing_files_raise_errors_naming_the_file(three_doc_prefix):
    os.remove(data_file_path(three_doc_prefix))
    with pytest.raises(IndexedDatasetError, match=r"three\.bin: data file not found"):
        MMapIndexedDataset(three_doc_prefix)
    os.remove(index_file_path(three_doc_prefix))
    with pytest.raises(IndexedDatasetError, match=r"three\.idx: index file not found"):
        make_dataset(three_doc_prefix, "infer")


def test_check_dataset_prefix_accepts_a_dataset_and_rejects_its_damage(three_doc_prefix):
    from megatron.core.data.indexed_dataset import check_dataset_prefix
    check_dataset_prefix(three_doc_prefix)
    _rewrite(data_file_path(three_doc_prefix), lambda data: data[:-2])
    with pytest.raises(IndexedDatasetError, match="three.bin"):
        check_dataset_prefix(three_doc_prefix)


@pytest.mark.parametrize("given, hint", [
    ("{prefix}.bin", "without the .bin extension: {prefix}"),
    ("{prefix}.idx", "without the .idx extension: {prefix}"),
    ("{directory}/docs", "{directory}/docs_text_document"),
    ("{directory}/nothing", "no nothing*.idx in {directory}"),
    ("{directory}/absent/docs_text_document", "the directory {directory}/absent does not exist"),
])
def test_check_dataset_prefix_hints_at_the_likely_prefix(tmp_path, given, hint):
    from megatron.core.data.indexed_dataset import check_dataset_prefix
    prefix = str(tmp_path / "docs_text_document")
    _build(prefix, [[[1, 2]]])
    values = {"prefix": prefix, "directory": str(tmp_path)}
    with pytest.raises(IndexedDatasetError) as error:
        check_dataset_prefix(given.format(**values))
    assert given.format(**values) in str(error.value) and hint.format(**values) in str(error.value)


def test_check_dataset_prefix_names_the_one_file_present(three_doc_prefix):
    from megatron.core.data.indexed_dataset import check_dataset_prefix
    os.remove(data_file_path(three_doc_prefix))
    with pytest.raises(IndexedDatasetError, match=r"only .*three\.idx exists"):
        check_dataset_prefix(three_doc_prefix)


def test_a_killed_writers_temporary_files_are_removed_by_the_next_writer(tmp_path):
    import subprocess
    import sys
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    prefix = str(tmp_path / "docs_text_document")
    abandoned = [tmp_path / f".docs_text_document.{suffix}.{dead_pid}.0badf00d.tmp" for suffix in ("bin", "idx")]
    live = tmp_path / f".docs_text_document.bin.{os.getpid()}.cafecafe.tmp"
    other = tmp_path / f".other_text_document.bin.{dead_pid}.0badf00d.tmp"
    for path in abandoned + [live, other]:
        path.write_bytes(b"partial")
    _build(prefix, [[[1, 2]]])
    assert not any(path.exists() for path in abandoned)
    assert live.exists() and other.exists()
    assert make_dataset(prefix, "mmap")[0].tolist() == [1, 2]


# ---------------------------------------------------------------- against the tokenizer's vocabulary


def test_check_vocabulary_accepts_ids_in_range_and_a_wider_dtype(tmp_path):
    for dtype in (np.uint16, np.int32, np.int64):
        prefix = str(tmp_path / f"ok_{np.dtype(dtype).name}")
        _build(prefix, [[[0, 999]], [[5] * 20]], dtype=dtype)
        check_vocabulary(MMapIndexedDataset(prefix), 1000)
    _build(str(tmp_path / "empty"), [[[]]])
    check_vocabulary(MMapIndexedDataset(str(tmp_path / "empty")), 1000)


@pytest.mark.parametrize("code, vocab_size, message", [
    (7, 1000, "tokens are stored as float64 (dtype code 7), which is not an integer type, but the tokenizer "
              "has 1000 tokens"),
    (3, 50257, "tokens are stored as int16 (dtype code 3), which holds ids up to 32767, but the tokenizer "
               "has 50257 tokens"),
])
def test_check_vocabulary_names_a_dtype_code_changed_between_sizes(tmp_path, code, vocab_size, message):
    """int64 -> float64 and uint16 -> int16 keep the item size, so the .bin's size still matches."""
    prefix = str(tmp_path / "flipped")
    _build(prefix, [[[1, 2, 3]]], dtype=np.int64 if code == 7 else np.uint16)
    raw = bytearray(open(index_file_path(prefix), "rb").read())
    raw[17] = code
    open(index_file_path(prefix), "wb").write(bytes(raw))
    with pytest.raises(IndexedDatasetError) as error:
        check_vocabulary(MMapIndexedDataset(prefix), vocab_size)
    assert str(error.value).startswith(f"{index_file_path(prefix)}: {message}: ")


def test_check_vocabulary_samples_ids_across_the_file(tmp_path):
    """The first ids of items spread over the file, the last item included, whatever the file's size;
    an id past the 16th of an item is not read (GPTDataset finds it when it reads the sample)."""
    rng = np.random.default_rng(0)
    documents = [[rng.integers(0, 1000, 30)] for _ in range(5000)]
    documents[-1][0][15] = 1000
    prefix = str(tmp_path / "last")
    _build(prefix, documents)
    with pytest.raises(IndexedDatasetError) as error:
        check_vocabulary(MMapIndexedDataset(prefix), 1000)
    assert str(error.value).startswith(f"{data_file_path(prefix)}: token id 1000 (item 4999) is outside the "
                                       f"tokenizer's vocabulary [0, 1000) (sampled across the file: 4096 ids in "
                                       f"[0, 1000] as uint16, 1 of them outside): the data was tokenized with "
                                       f"another tokenizer")
    documents[-1][0][15] = 0
    documents[-1][0][16] = 1000
    _build(prefix, documents)
    check_vocabulary(MMapIndexedDataset(prefix), 1000)


def test_check_dataset_prefix_checks_the_vocabulary_when_given_one(three_doc_prefix):
    check_dataset_prefix(three_doc_prefix, "infer")
    check_dataset_prefix(three_doc_prefix, "infer", vocab_size=8)
    with pytest.raises(IndexedDatasetError, match=r"three\.bin: token id 7 \(item 3\) is outside"):
        check_dataset_prefix(three_doc_prefix, "infer", vocab_size=7)


# ---------------------------------------------------------------- writing on a full or read-only disk


def test_a_full_disk_is_named_and_leaves_nothing(tmp_path, three_doc_prefix, monkeypatch):
    """Full while the items are written, or while the index is: one IndexedDatasetError naming the
    output and the cause; the temporary files are gone and the earlier dataset is untouched."""
    earlier = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    for capacity in (100, 4010):  # the items (4000 bytes) or the index (74 bytes) do not fit
        full_disk(monkeypatch, tmp_path, capacity=capacity)
        with pytest.raises(IndexedDatasetError) as error:
            with IndexedDatasetBuilder(data_file_path(three_doc_prefix), dtype=np.uint16) as builder:
                builder.add_document(np.arange(2000) % 7, [1000, 1000])
                builder.finalize(index_file_path(three_doc_prefix))
        monkeypatch.undo()
        path = data_file_path(three_doc_prefix) if capacity < 4000 else index_file_path(three_doc_prefix)
        assert str(error.value) == f"cannot write {path}: No space left on device", capacity
        assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == earlier


def test_a_read_only_directory_is_named_and_leaves_nothing(tmp_path, monkeypatch):
    read_only(monkeypatch, tmp_path)
    with pytest.raises(IndexedDatasetError) as error:
        IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=np.uint16)
    monkeypatch.undo()
    assert re.fullmatch(rf"cannot write {tmp_path}/x\.bin \({tmp_path}/\.x\.bin\.\d+\.[0-9a-f]+\.tmp\): "
                        r"Read-only file system", str(error.value))
    assert os.listdir(tmp_path) == []


def test_make_output_directory_names_what_is_in_the_way(tmp_path):
    (tmp_path / "file").write_text("")
    make_output_directory(str(tmp_path / "new" / "deeper"), "--output-prefix p")
    assert (tmp_path / "new" / "deeper").is_dir()
    with pytest.raises(IndexedDatasetError, match=rf"^--output-prefix p: cannot create the directory {tmp_path}/file: "
                                                  "a file of that name exists$"):
        make_output_directory(str(tmp_path / "file"), "--output-prefix p")
    with pytest.raises(IndexedDatasetError, match=rf"^--output-prefix p: cannot create the directory "
                                                  rf"{tmp_path}/file/sub: Not a directory$"):
        make_output_directory(str(tmp_path / "file" / "sub"), "--output-prefix p")
