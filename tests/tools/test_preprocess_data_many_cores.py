"""tools/preprocess_data_many_cores.py: identical output to preprocess_data.py, whatever the order."""
import gzip
import json
import os
import signal
import sys
import time

import pytest

from megatron.core.data.indexed_dataset import IndexedDatasetError, MMapIndexedDataset, make_dataset
from tests.conftest import REPO_ROOT
from tests.tools.test_preprocess_data import TOOL as SERIAL_TOOL
from tests.tools.test_preprocess_data import (
    corpus_texts,
    fuzzed_input,
    kill_midway,
    pid_alive,
    read_bytes,
    run_in_process,
    tokenizer_flags,
)
from tools.preprocess_data import preprocess
from tools.preprocess_data_many_cores import preprocess_many_cores

TOOL = os.path.join(REPO_ROOT, "tools", "preprocess_data_many_cores.py")


@pytest.fixture
def uneven_corpus(tmp_path, sample_corpus):
    """Part of the corpus led by one very long document, so the first chunk finishes last."""
    texts = corpus_texts(sample_corpus)[:400]
    long_document = "\n\n".join(texts[:100])
    path = tmp_path / "uneven.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in [long_document] + texts))
    return str(path)


@pytest.mark.distributed
def test_many_cores_output_is_byte_identical_to_serial(tmp_path, uneven_corpus, gpt2_tokenizer_files,
                                                       capsys):
    flags = ["--input", uneven_corpus, "--append-eod"] + tokenizer_flags(gpt2_tokenizer_files)
    serial = str(tmp_path / "serial")
    assert run_in_process(preprocess, flags + ["--output-prefix", serial], capsys)[0] == 0
    for workers, chunk_size in ((2, 1), (2, 7), (3, 64)):
        prefix = str(tmp_path / f"many{workers}_{chunk_size}")
        status, err = run_in_process(preprocess_many_cores, flags + [
            "--output-prefix", prefix, "--workers", str(workers), "--chunk-size", str(chunk_size)], capsys)
        assert status == 0, err
        assert read_bytes(prefix + "_text_document") == read_bytes(serial + "_text_document")
    assert sorted(os.listdir(tmp_path)) == sorted(
        [f"{name}_text_document.{ext}" for name in ("serial", "many2_1", "many2_7", "many3_64")
         for ext in ("bin", "idx")] + ["uneven.jsonl"])


@pytest.mark.distributed
def test_many_cores_bad_lines_and_strict_match_serial(tmp_path, sample_corpus, gpt2_tokenizer_files,
                                                      capsys):
    path = str(tmp_path / "fuzz.jsonl")
    _, bad_lines = fuzzed_input(path, corpus_texts(sample_corpus)[:80], seed=5)
    flags = ["--input", path, "--chunk-size", "3"] + tokenizer_flags(gpt2_tokenizer_files)
    status, serial_err = run_in_process(preprocess, flags + ["--output-prefix", str(tmp_path / "s")], capsys)
    assert status == 0
    status, many_err = run_in_process(preprocess_many_cores, flags + ["--output-prefix", str(tmp_path / "m"),
                                                                      "--workers", "2"], capsys)
    assert status == 0
    summary = serial_err[serial_err.index("Skipped"):]
    assert summary == many_err[many_err.index("Skipped"):]
    assert f"Skipped {sum(map(len, bad_lines.values()))} bad lines" in summary
    assert read_bytes(str(tmp_path / "s_text_document")) == read_bytes(str(tmp_path / "m_text_document"))

    first_line = min(lines[0] for lines in bad_lines.values())
    status, err = run_in_process(preprocess_many_cores, flags + ["--output-prefix", str(tmp_path / "strict"),
                                                                 "--workers", "2", "--strict"], capsys)
    assert status == 1 and f"error: {path}:{first_line}: " in err and "--strict" in err
    assert not [name for name in os.listdir(tmp_path) if name.startswith(("strict", ".strict"))]


@pytest.mark.distributed
def test_killed_many_cores_run_leaves_no_complete_output(tmp_path, sample_corpus, gpt2_tokenizer_files):
    with gzip.open(sample_corpus, "rb") as corpus:
        lines = corpus.readlines()
    prefix = str(tmp_path / "killed")
    argv = ["--output-prefix", prefix, "--workers", "2", "--chunk-size", "4", "--log-interval", "4"] \
        + tokenizer_flags(gpt2_tokenizer_files)
    assert kill_midway(TOOL, argv, lines, str(tmp_path))[0] == -signal.SIGKILL
    leftovers = os.listdir(tmp_path)
    assert leftovers and all(name.endswith(".tmp") for name in leftovers), leftovers
    assert not MMapIndexedDataset.exists(prefix + "_text_document")
    with pytest.raises(IndexedDatasetError, match="index file not found"):
        make_dataset(prefix + "_text_document", impl="infer")


@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
@pytest.mark.parametrize("tool", [TOOL, SERIAL_TOOL], ids=["many_cores", "preprocess_data"])
def test_workers_end_when_the_main_process_is_killed(tool, tmp_path, sample_corpus, gpt2_tokenizer_files):
    """Killing only the main process (not its group) leaves no pool worker behind: the workers'
    task pipe reaches end-of-file once no writer is left."""
    with gzip.open(sample_corpus, "rb") as corpus:
        lines = corpus.readlines()
    argv = ["--output-prefix", str(tmp_path / "orphans"), "--workers", "2", "--chunk-size", "4",
            "--log-interval", "4"] + tokenizer_flags(gpt2_tokenizer_files)
    status, workers = kill_midway(tool, argv, lines, str(tmp_path), whole_group=False)
    assert status == -signal.SIGKILL and len(workers) >= 2, workers
    deadline = time.monotonic() + 20
    while any(pid_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in workers if pid_alive(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors
