"""tools/merge_preprocessed_data.py: shard, preprocess, merge == preprocess the whole."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.core.data.indexed_dataset import (
    IndexedDatasetBuilder,
    MMapIndexedDataset,
    data_file_path,
    index_file_path,
)
from tests.conftest import REPO_ROOT
from tests.disk_faults import full_disk, read_only
from tests.tools.test_preprocess_data import corpus_texts, read_bytes, run_in_process, tokenizer_flags
from tools.merge_preprocessed_data import main as merge_main
from tools.preprocess_data import preprocess

TOOL = os.path.join(REPO_ROOT, "tools", "merge_preprocessed_data.py")


def _write_jsonl(path, texts):
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return str(path)


def _build(prefix, documents, dtype):
    builder = IndexedDatasetBuilder(data_file_path(prefix), dtype)
    for document in documents:
        builder.add_item(document)
        builder.end_document()
    builder.finalize(index_file_path(prefix))
    return prefix


def test_shard_then_merge_equals_preprocessing_the_whole(tmp_path, sample_corpus, gpt2_tokenizer_files,
                                                         capsys):
    texts = corpus_texts(sample_corpus)
    bounds = [0, 400, 401, 900, len(texts)]
    flags = ["--append-eod"] + tokenizer_flags(gpt2_tokenizer_files)
    whole = _write_jsonl(tmp_path / "whole.jsonl", texts)
    assert run_in_process(preprocess, ["--input", whole, "--output-prefix", str(tmp_path / "whole")] + flags,
                          capsys)[0] == 0
    shard_prefixes = []
    for k, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        shard = _write_jsonl(tmp_path / f"shard{k}.jsonl", texts[start:stop])
        assert run_in_process(preprocess, ["--input", shard, "--output-prefix", str(tmp_path / f"shard{k}")]
                              + flags, capsys)[0] == 0
        shard_prefixes.append(str(tmp_path / f"shard{k}_text_document"))
    out_dir = tmp_path / "merged"
    merged = str(out_dir / "all_text_document")
    result = subprocess.run([sys.executable, TOOL, "--datasets"] + shard_prefixes + ["--output-prefix", merged],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"{len(texts)} documents" in result.stderr
    assert read_bytes(merged) == read_bytes(str(tmp_path / "whole_text_document"))
    assert sorted(os.listdir(out_dir)) == ["all_text_document.bin", "all_text_document.idx"]


def test_merge_keeps_document_boundaries_of_multi_item_documents(tmp_path, capsys):
    first = str(tmp_path / "first")
    builder = IndexedDatasetBuilder(data_file_path(first), np.int32)
    builder.add_document([1, 2, 3, 4], [2, 2])
    builder.add_document([5], [1])
    builder.finalize(index_file_path(first))
    second = _build(str(tmp_path / "second"), [[6, 7], [8]], np.int32)
    out = str(tmp_path / "out")
    assert merge_main(["--datasets", first, second, "--output-prefix", out]) == 0
    merged = MMapIndexedDataset(out)
    assert merged.doc_idx.tolist() == [0, 2, 3, 4, 5]
    assert [merged[i].tolist() for i in range(len(merged))] == [[1, 2], [3, 4], [5], [6, 7], [8]]
    assert merged.pointers.tolist() == [0, 8, 16, 20, 28]


def test_dtype_mismatch_is_rejected_naming_both_files(tmp_path, capsys):
    narrow = _build(str(tmp_path / "narrow"), [[1, 2]], np.uint16)
    wide = _build(str(tmp_path / "wide"), [[3]], np.int32)
    out = str(tmp_path / "out")
    assert merge_main(["--datasets", narrow, wide, "--output-prefix", out]) == 1
    err = capsys.readouterr().err
    assert "wide.bin (dtype int32)" in err and "narrow.bin (dtype uint16)" in err and "same dtype" in err
    assert sorted(os.listdir(tmp_path)) == ["narrow.bin", "narrow.idx", "wide.bin", "wide.idx"]


def test_bad_inputs_are_rejected_with_a_message(tmp_path, capsys):
    good = _build(str(tmp_path / "good"), [[1]], np.uint16)
    assert merge_main(["--datasets", good, str(tmp_path / "absent"), "--output-prefix", str(tmp_path / "o")]) == 1
    assert "absent.idx: index file not found" in capsys.readouterr().err
    assert merge_main(["--datasets", good, "--output-prefix", good]) == 1
    assert "is also one of --datasets" in capsys.readouterr().err
    assert merge_main(["--datasets", good, "--output-prefix", str(tmp_path / "o"), "--merge", "distributed"]) == 1
    assert "--merge distributed is not supported" in capsys.readouterr().err
    with open(data_file_path(good), "ab") as f:
        f.write(b"\x00")
    assert merge_main(["--datasets", good, "--output-prefix", str(tmp_path / "o")]) == 1
    assert "good.bin: data file has 3 bytes" in capsys.readouterr().err
    assert not [name for name in os.listdir(tmp_path) if name.startswith(("o", ".o"))]


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_an_unwritable_output_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys, fault):
    """A merged dataset written earlier at the output prefix stays byte for byte; no temporary file is left."""
    rng = np.random.default_rng(0)
    inputs = [_build(str(tmp_path / f"in{i}"), [rng.integers(0, 1000, 3000) for _ in range(4)], np.uint16)
              for i in range(2)]
    out = tmp_path / "out"
    argv = ["--datasets", *inputs, "--output-prefix", str(out / "merged")]
    assert merge_main(argv) == 0
    earlier = read_bytes(str(out / "merged"))
    before = sorted(os.listdir(out))
    capsys.readouterr()
    if fault == "read-only":
        read_only(monkeypatch, out)
    else:
        full_disk(monkeypatch, out, capacity=8000)
    status = merge_main(argv)
    monkeypatch.undo()
    err = capsys.readouterr().err
    cause = "Read-only file system" if fault == "read-only" else "No space left on device"
    assert status == 1 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: cannot write {out / 'merged'}.bin") and err.strip().endswith(cause), err
    assert sorted(os.listdir(out)) == before and read_bytes(str(out / "merged")) == earlier
