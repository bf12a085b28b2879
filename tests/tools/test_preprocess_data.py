"""tools/preprocess_data.py: round trip, bad input, flags, and interrupted runs."""
import gzip
import json
import lzma
import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from megatron.core.data.indexed_dataset import IndexedDatasetError, MMapIndexedDataset, make_dataset
from megatron.core.tokenizer import build_tokenizer
from tests.conftest import REPO_ROOT
from tests.core.data.test_preprocessing import punkt_data_dir, use_punkt  # noqa: F401
from tests.disk_faults import full_disk, read_only
from tests.training.e2e_utils import run_command
from tools.preprocess_data import preprocess, run_tool
from tools.preprocess_data_many_cores import preprocess_many_cores

TOOL = os.path.join(REPO_ROOT, "tools", "preprocess_data.py")


def tokenizer_flags(files):
    vocab_file, merge_file = files
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file, "--merge-file", merge_file]


def corpus_texts(sample_corpus):
    with gzip.open(sample_corpus, "rt", encoding="utf-8") as corpus:
        return [json.loads(line)["text"] for line in corpus]


def read_bytes(prefix):
    with open(prefix + ".bin", "rb") as data, open(prefix + ".idx", "rb") as index:
        return data.read(), index.read()


def run_in_process(tool_function, argv, capsys):
    """Run a preprocessing tool in this process: (exit status, stderr)."""
    status = run_tool(tool_function, argv)
    return status, capsys.readouterr().err


def _wait_for_written_temporary_file(directory, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sizes = [os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)
                 if name.endswith(".tmp") and os.path.isfile(os.path.join(directory, name))]
        if any(sizes):
            return
        time.sleep(0.05)
    raise AssertionError(f"no temporary output with data appeared in {directory}")


def _state_and_parent(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) from /proc/PID/stat; None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def pid_alive(pid: int) -> bool:
    found = _state_and_parent(pid)
    return found is not None and found[0] != "Z"


def child_pids(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``."""
    found = {int(entry): _state_and_parent(int(entry)) for entry in os.listdir("/proc") if entry.isdigit()}
    return [child for child, stat in found.items() if stat is not None and stat[0] != "Z" and stat[1] == pid]


def kill_midway(tool_path, argv, corpus_lines, output_dir, whole_group=True):
    """Feed half the corpus through a FIFO, SIGKILL the tool once it reports progress: its process
    group, or with ``whole_group=False`` the main process alone. Returns (exit status, the pids of
    its children just before the kill)."""
    fifo = os.path.join(output_dir, "input.jsonl")
    os.mkfifo(fifo)
    process = subprocess.Popen([sys.executable, tool_path, "--input", fifo] + argv,
                               stderr=subprocess.PIPE, start_new_session=True)
    children = []
    try:
        with open(fifo, "wb") as writer:
            writer.writelines(corpus_lines[: len(corpus_lines) // 2])
            writer.flush()
            seen = []
            for line in process.stderr:
                seen.append(line.decode())
                if line.startswith(b"Processed"):
                    break
            assert any(s.startswith("Processed") for s in seen), "".join(seen)
            _wait_for_written_temporary_file(output_dir)
            children = child_pids(process.pid)
            if whole_group:
                os.killpg(process.pid, signal.SIGKILL)
            else:
                os.kill(process.pid, signal.SIGKILL)
            process.wait()
    except BrokenPipeError:
        pass
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        process.stderr.close()
    os.remove(fifo)
    return process.returncode, children


def test_round_trip_recovers_every_document(tmp_path, sample_corpus, gpt2_tokenizer_files, capsys):
    prefix = str(tmp_path / "docs")
    status, err = run_in_process(preprocess, ["--input", sample_corpus, "--output-prefix", prefix,
                                              "--append-eod", "--log-interval", "500"]
                                 + tokenizer_flags(gpt2_tokenizer_files), capsys)
    assert status == 0, err
    tokenizer = build_tokenizer("GPT2BPETokenizer", *gpt2_tokenizer_files)
    texts = corpus_texts(sample_corpus)
    dataset = make_dataset(prefix + "_text_document", impl="mmap")
    assert dataset.dtype == np.uint16 and len(dataset) == len(texts)
    assert dataset.doc_idx.tolist() == list(range(len(texts) + 1))
    for i, text in enumerate(texts):
        tokens = dataset[i]
        assert tokens[-1] == tokenizer.eod and tokenizer.eod not in tokens[:-1]
        assert tokenizer.detokenize(tokens[:-1].tolist()) == text
    assert re.search(r"Processed 512 documents \([\d.]+ docs/s, [\d.]+ MB/s\)\.", err)
    assert f"Wrote {len(texts)} documents" in err and "No bad lines." in err
    assert sorted(os.listdir(tmp_path)) == ["docs_text_document.bin", "docs_text_document.idx"]


def test_without_append_eod_no_eod_is_written(tmp_path, sample_corpus, gpt2_tokenizer_files, capsys):
    prefix = str(tmp_path / "plain")
    status, err = run_in_process(preprocess, ["--input", sample_corpus, "--output-prefix", prefix]
                                 + tokenizer_flags(gpt2_tokenizer_files), capsys)
    assert status == 0, err
    tokenizer = build_tokenizer("GPT2BPETokenizer", *gpt2_tokenizer_files)
    dataset = MMapIndexedDataset(prefix + "_text_document")
    texts = corpus_texts(sample_corpus)
    all_tokens = np.fromfile(prefix + "_text_document.bin", dtype=np.uint16)
    assert tokenizer.eod not in all_tokens
    assert int(dataset.sizes.sum()) == sum(len(tokenizer.tokenize(t)) for t in texts)
    assert tokenizer.detokenize(dataset[7].tolist()) == texts[7]


BAD_LINES = {
    "malformed_json": [b'{"text": "unclosed\n', b"{'text': 'single quotes'}\n"],
    "missing_key": [b'{"body": "no text key"}\n'],
    "non_string_text": [b'{"text": 12}\n', b'{"text": null}\n', b'{"text": {"a": 1}}\n'],
    "empty_text": [b'{"text": ""}\n', b'{"text": "  \\n\\t  "}\n'],
    "invalid_utf8": [b'{"text": "latin-1 caf\xe9"}\n', b'{"text": "\xff\xfe"}\n'],
    "blank_line": [b"\n", b"   \n"],
    "not_an_object": [b'[1, 2, 3]\n'],
    "tokenizer_error": [b'{"text": "lone surrogate \\ud800 here"}\n'],
}


def fuzzed_input(path, texts, seed):
    """Write good documents mixed with bad lines of every kind; return (good texts, {kind: [lines]})."""
    rng = random.Random(seed)
    entries = [("good", text) for text in texts] + [
        (kind, raw) for kind, samples in BAD_LINES.items() for raw in samples for _ in range(rng.randint(1, 3))]
    rng.shuffle(entries)
    good, bad_lines = [], {}
    with open(path, "wb") as f:
        for number, (kind, value) in enumerate(entries, start=1):
            if kind == "good":
                f.write(json.dumps({"text": value}).encode() + b"\n")
                good.append(value)
            else:
                f.write(value)
                bad_lines.setdefault(kind, []).append(number)
        f.write(b'{"text": "the last line is cut')
        bad_lines["truncated_last_line"] = [len(entries) + 1]
    return good, bad_lines


def test_fuzzed_bad_input_is_skipped_and_counted(tmp_path, sample_corpus, gpt2_tokenizer_files, capsys):
    path = str(tmp_path / "fuzz.jsonl")
    good, bad_lines = fuzzed_input(path, corpus_texts(sample_corpus)[:60], seed=3)
    prefix = str(tmp_path / "fuzz")
    status, err = run_in_process(preprocess, ["--input", path, "--output-prefix", prefix, "--append-eod",
                                              "--chunk-size", "16"] + tokenizer_flags(gpt2_tokenizer_files), capsys)
    assert status == 0, err
    total_bad = sum(len(lines) for lines in bad_lines.values())
    assert f"Skipped {total_bad} bad lines:" in err
    for kind, lines in bad_lines.items():
        first = ", ".join(f"{path}:{n}" for n in lines[:5])
        assert re.search(rf"  {kind}: {len(lines)} \(.*\); at {re.escape(first)}", err), (kind, err)
    tokenizer = build_tokenizer("GPT2BPETokenizer", *gpt2_tokenizer_files)
    dataset = MMapIndexedDataset(prefix + "_text_document")
    assert [tokenizer.detokenize(dataset[i][:-1].tolist()) for i in range(len(dataset))] == good


def test_strict_stops_at_the_first_bad_line(tmp_path, sample_corpus, gpt2_tokenizer_files, capsys):
    path = str(tmp_path / "fuzz.jsonl")
    _, bad_lines = fuzzed_input(path, corpus_texts(sample_corpus)[:60], seed=4)
    first_kind, first_line = min(((kind, lines[0]) for kind, lines in bad_lines.items()), key=lambda kl: kl[1])
    prefix = str(tmp_path / "strict")
    status, err = run_in_process(preprocess, ["--input", path, "--output-prefix", prefix, "--strict",
                                              "--chunk-size", "8"] + tokenizer_flags(gpt2_tokenizer_files), capsys)
    assert status == 1
    assert f"error: {path}:{first_line}: " in err and f"({first_kind}); stopping because of --strict" in err
    assert os.listdir(tmp_path) == ["fuzz.jsonl"]


def test_compressed_inputs_and_globs_concatenate_in_order(tmp_path, sample_corpus, gpt2_tokenizer_files,
                                                          capsys):
    texts = corpus_texts(sample_corpus)[:90]
    lines = [json.dumps({"text": t}).encode() + b"\n" for t in texts]
    shards = tmp_path / "shards"
    shards.mkdir()
    with open(shards / "part0.jsonl", "wb") as f:
        f.writelines(lines[:30])
    with gzip.open(shards / "part1.jsonl.gz", "wb") as f:
        f.writelines(lines[30:60])
    with lzma.open(shards / "part2.jsonl.xz", "wb") as f:
        f.writelines(lines[60:])
    whole = tmp_path / "whole.jsonl"
    whole.write_bytes(b"".join(lines))
    flags = tokenizer_flags(gpt2_tokenizer_files) + ["--append-eod"]
    assert run_in_process(preprocess, ["--input", str(whole), "--output-prefix", str(tmp_path / "a")] + flags,
                          capsys)[0] == 0
    assert run_in_process(preprocess, ["--input", str(shards / "part*"), "--output-prefix",
                                       str(tmp_path / "b")] + flags, capsys)[0] == 0
    assert read_bytes(str(tmp_path / "a_text_document")) == read_bytes(str(tmp_path / "b_text_document"))


@pytest.mark.distributed
def test_workers_give_identical_output(tmp_path, sample_corpus, gpt2_tokenizer_files, capsys):
    flags = ["--input", sample_corpus, "--append-eod"] + tokenizer_flags(gpt2_tokenizer_files)
    assert run_in_process(preprocess, flags + ["--output-prefix", str(tmp_path / "one")], capsys)[0] == 0
    assert run_in_process(preprocess, flags + ["--output-prefix", str(tmp_path / "two"), "--workers", "2",
                                               "--chunk-size", "5"], capsys)[0] == 0
    assert read_bytes(str(tmp_path / "one_text_document")) == read_bytes(str(tmp_path / "two_text_document"))


def test_several_json_keys_write_aligned_datasets(tmp_path, gpt2_tokenizer_files, capsys):
    path = tmp_path / "titled.jsonl"
    records = [{"title": "One", "text": "First body."}, {"text": "No title."},
               {"title": "Three", "text": "Third body."}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    prefix = str(tmp_path / "titled")
    status, err = run_in_process(preprocess, ["--input", str(path), "--output-prefix", prefix, "--json-keys",
                                              "text", "title"] + tokenizer_flags(gpt2_tokenizer_files), capsys)
    assert status == 0 and "missing_key: 1" in err
    tokenizer = build_tokenizer("GPT2BPETokenizer", *gpt2_tokenizer_files)
    for key, expected in (("text", ["First body.", "Third body."]), ("title", ["One", "Three"])):
        dataset = MMapIndexedDataset(f"{prefix}_{key}_document")
        assert [tokenizer.detokenize(dataset[i].tolist()) for i in range(len(dataset))] == expected


def test_split_sentences_writes_sentence_items(tmp_path, sample_corpus, gpt2_tokenizer_files, use_punkt,  # noqa: F811
                                               capsys):
    texts = corpus_texts(sample_corpus)[:40]
    path = tmp_path / "few.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenizer = build_tokenizer("GPT2BPETokenizer", *gpt2_tokenizer_files)
    for keep_newlines in (False, True):
        prefix = str(tmp_path / f"sentences{int(keep_newlines)}")
        argv = ["--input", str(path), "--output-prefix", prefix, "--split-sentences", "--append-eod"]
        status, err = run_in_process(preprocess, argv + ["--keep-newlines"] * keep_newlines
                                     + tokenizer_flags(gpt2_tokenizer_files), capsys)
        assert status == 0, err
        dataset = MMapIndexedDataset(prefix + "_text_sentence")
        assert len(dataset.doc_idx) == len(texts) + 1 and len(dataset) > 2 * len(texts)
        for d, text in enumerate(texts):
            start, stop = dataset.doc_idx[d], dataset.doc_idx[d + 1]
            ids = np.concatenate([dataset[i] for i in range(start, stop)]).tolist()
            assert ids[-1] == tokenizer.eod
            joined = tokenizer.detokenize(ids[:-1])
            if keep_newlines:
                assert joined == text.rstrip()
            else:
                assert re.sub(r"\s", "", joined) == re.sub(r"\s", "", text)


def test_pretrained_from_hf_directory(tmp_path, gpt2_tokenizer_files, capsys):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE.from_file(*gpt2_tokenizer_files))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    hf_dir = str(tmp_path / "hf")
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(hf_dir)
    path = tmp_path / "two.jsonl"
    path.write_text('{"text": "Hello there."}\n{"text": "General Kenobi!"}\n')
    prefix = str(tmp_path / "hf_out")
    status, err = run_in_process(preprocess, ["--input", str(path), "--output-prefix", prefix, "--tokenizer-type",
                                              "PretrainedFromHF", "--tokenizer-name-or-path", hf_dir,
                                              "--append-eod"], capsys)
    assert status == 0, err
    reference = build_tokenizer("GPT2BPETokenizer", *gpt2_tokenizer_files)
    dataset = MMapIndexedDataset(prefix + "_text_document")
    assert dataset[1].tolist() == reference.tokenize("General Kenobi!") + [reference.eod]


@pytest.mark.parametrize("extra, message", [
    (["--dataset-impl", "cached"], "--dataset-impl cached (the legacy TNTIDX format) is not supported"),
    (["--dataset-impl", "lazy"], "--dataset-impl lazy"),
    (["--workers", "0"], "--workers must be at least 1"),
    (["--chunk-size", "0"], "--chunk-size must be at least 1"),
    (["--log-interval", "0"], "--log-interval must be at least 1"),
    (["--json-keys", "text", "text"], "--json-keys has duplicates"),
    (["--pad-vocab-size-to", "100"], "--pad-vocab-size-to 100"),
])
def test_bad_flags_are_rejected_with_a_message(tmp_path, sample_corpus, gpt2_tokenizer_files, capsys,
                                               extra, message):
    argv = ["--input", sample_corpus, "--output-prefix", str(tmp_path / "x")] + tokenizer_flags(gpt2_tokenizer_files)
    status, err = run_in_process(preprocess, argv + extra, capsys)
    assert status == 1 and message in err
    assert os.listdir(tmp_path) == []


def test_bad_tokenizer_and_input_flags(tmp_path, sample_corpus, gpt2_tokenizer_files, capsys):
    out = ["--output-prefix", str(tmp_path / "x")]
    status, err = run_in_process(preprocess, ["--input", sample_corpus, "--tokenizer-type", "BertWordPieceCase"]
                                 + out, capsys)
    assert status == 1 and "BertWordPieceCase is not supported" in err
    status, err = run_in_process(preprocess, ["--input", sample_corpus, "--tokenizer-type", "GPT2BPETokenizer"]
                                 + out, capsys)
    assert status == 1 and "--vocab-file" in err
    status, err = run_in_process(preprocess, ["--input", str(tmp_path / "nope*.jsonl")] + out
                                 + tokenizer_flags(gpt2_tokenizer_files), capsys)
    assert status == 1 and "--input" in err and "matches no file" in err


def test_split_sentences_without_punkt_model_names_the_flag(tmp_path, sample_corpus,
                                                            gpt2_tokenizer_files):
    env = dict(os.environ, NLTK_DATA=str(tmp_path), HOME=str(tmp_path))
    result = subprocess.run([sys.executable, TOOL, "--input", sample_corpus, "--output-prefix", str(tmp_path / "s"),
                             "--split-sentences"] + tokenizer_flags(gpt2_tokenizer_files),
                            capture_output=True, text=True, env=env, timeout=120)
    if "punkt_tab" not in result.stderr and os.path.exists("/usr/share/nltk_data/tokenizers/punkt_tab"):
        pytest.skip("a system-wide punkt_tab model is installed")
    assert result.returncode == 1
    assert "error: --split-sentences needs NLTK's punkt_tab model" in result.stderr


def test_killed_run_leaves_no_complete_output(tmp_path, sample_corpus, gpt2_tokenizer_files):
    with gzip.open(sample_corpus, "rb") as corpus:
        lines = corpus.readlines()
    prefix = str(tmp_path / "killed")
    argv = ["--output-prefix", prefix, "--chunk-size", "8", "--log-interval", "8"] \
        + tokenizer_flags(gpt2_tokenizer_files)
    assert kill_midway(TOOL, argv, lines, str(tmp_path))[0] == -signal.SIGKILL
    leftovers = os.listdir(tmp_path)
    assert leftovers and all(name.endswith(".tmp") for name in leftovers), leftovers
    assert not MMapIndexedDataset.exists(prefix + "_text_document")
    with pytest.raises(IndexedDatasetError, match="index file not found"):
        make_dataset(prefix + "_text_document", impl="infer")


@pytest.mark.parametrize("tool, workers", [("preprocess_data.py", "1"), ("preprocess_data.py", "2"),
                                           ("preprocess_data_many_cores.py", "2")])
@pytest.mark.parametrize("json_keys, absent", [(["text"], "'text'"), (["content", "title"], "'title'")])
def test_no_usable_line_fails_naming_the_keys_and_leaves_no_dataset(tmp_path, gpt2_tokenizer_files, tool, workers,
                                                                     json_keys, absent):
    """Every line lacks a --json-keys key (a wrong key, or one key that no line has): exit 1 naming the
    input, the key no line has and the keys the lines do have; no output of any key and no temporary
    file is left, and an earlier dataset of the same prefix stays byte for byte."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"content": f"document {i}", "id": i}) + "\n" for i in range(40)))
    prefix = str(tmp_path / "out")
    earlier_prefix = f"{prefix}_content_document"
    command = [sys.executable, os.path.join(REPO_ROOT, "tools", tool), "--input", str(corpus), "--output-prefix",
               prefix, "--workers", workers, "--chunk-size", "8"] + tokenizer_flags(gpt2_tokenizer_files)
    run_command(command + ["--json-keys", "content"], timeout=120).assert_ok()
    earlier = read_bytes(earlier_prefix)
    before = sorted(os.listdir(tmp_path))
    assert before == ["corpus.jsonl", "out_content_document.bin", "out_content_document.idx"]

    result = run_command(command + ["--json-keys", *json_keys], timeout=120)

    assert result.returncode == 1, result.output
    asked = ", ".join(repr(key) for key in json_keys)
    assert (f"error: {corpus}: no line has usable text under --json-keys {asked}, so no dataset was written; "
            f"its first 40 lines have the keys 'content', 'id', and none has {absent}") in result.output
    assert "missing_key: 40" in result.output
    assert sorted(os.listdir(tmp_path)) == before
    assert read_bytes(earlier_prefix) == earlier


def numbered_keys_line(count):
    return json.dumps({f"k{i:02d}": "x" for i in range(count)}) + "\n"


@pytest.mark.parametrize("lines, message", [
    ([], "the input has no lines, so no dataset was written"),
    (["{not json\n", "[1, 2]\n", "\n"], "so no dataset was written; none of its first 3 lines is a JSON object"),
    (['{"text": ""}\n', '{"text": " ", "id": 2}\n'],
     "so no dataset was written; its first 2 lines have the keys 'id', 'text' (the summary above"),
    ([numbered_keys_line(25)], "its first 1 lines have the keys "
     + ", ".join(f"'k{i:02d}'" for i in range(20)) + ", ..., and none has 'text'"),
    (['{"a": "x"}\n'] * 1000 + ['{"late": "x"}\n'],
     "its first 1000 lines have the keys 'a', and none has 'text' (the summary above"),
])
def test_no_usable_line_message_describes_the_input(tmp_path, gpt2_tokenizer_files, capsys, lines,
                                                    message):
    """Empty input, lines that are no JSON object, empty texts, more than 20 keys (the first 20 are
    named), and a key past the first 1000 lines (not read again): each fails and writes nothing."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(lines))
    argv = ["--input", str(corpus), "--output-prefix", str(tmp_path / "out")] + tokenizer_flags(gpt2_tokenizer_files)
    status, err = run_in_process(preprocess, argv, capsys)
    assert status == 1, err
    assert f"error: {corpus}: " in err and message in err, err
    assert os.listdir(tmp_path) == ["corpus.jsonl"]


def test_an_input_directory_is_named_as_a_directory(tmp_path, gpt2_tokenizer_files, capsys):
    (tmp_path / "corpus").mkdir()
    argv = ["--input", str(tmp_path / "corpus"), "--output-prefix", str(tmp_path / "out")]
    status, err = run_in_process(preprocess, argv + tokenizer_flags(gpt2_tokenizer_files), capsys)
    assert status == 1
    assert err.strip() == (f"error: --input {tmp_path / 'corpus'}: is a directory; give the jsonl files in it, "
                           f"or a glob such as {tmp_path / 'corpus' / '*.jsonl'}")
    assert os.listdir(tmp_path) == ["corpus"]


# (where the output goes, the fault injected there, what the one line says)
OUTPUT_FAULTS = {
    "read-only": ("out/x", lambda monkeypatch, out: read_only(monkeypatch, out), "{out}"),
    # full: the final .bin, or with workers a chunk in the parts folder (each worker process has its own
    # budget, and how many chunks a worker takes varies from run to run)
    "full": ("out/x", lambda monkeypatch, out: full_disk(monkeypatch, out, capacity=64 * 1024),
             "cannot write {out}/"),
    "a file in the way": ("a_file/x", None, "--output-prefix {tmp}/a_file/x: cannot create the directory "
                                            "{tmp}/a_file: a file of that name exists"),
    "under a file": ("a_file/new/x", None, "--output-prefix {tmp}/a_file/new/x: cannot create the directory "
                                           "{tmp}/a_file/new: Not a directory"),
}
CAUSES = {"read-only": "Read-only file system", "full": "No space left on device"}


@pytest.mark.parametrize("fault", sorted(OUTPUT_FAULTS))
@pytest.mark.parametrize("tool, workers", [(preprocess, "1"), (preprocess_many_cores, "2")],
                         ids=["serial", "many_cores"])
def test_an_unwritable_output_is_one_line_and_leaves_nothing(tmp_path, sample_corpus, gpt2_tokenizer_files, capsys,
                                                             monkeypatch, fault, tool, workers):
    """A read-only or full output directory, or a file where it should be: exit 1 with one line naming
    the path and the cause; no temporary file is left and the dataset an earlier run wrote there stays
    byte for byte."""
    where, inject, message = OUTPUT_FAULTS[fault]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in corpus_texts(sample_corpus)[:150]))
    (tmp_path / "a_file").write_text("not a directory")
    out = tmp_path / "out"
    argv = ["--input", str(corpus), "--output-prefix", str(tmp_path / where), "--workers", workers,
            "--chunk-size", "16"] + tokenizer_flags(gpt2_tokenizer_files)
    assert run_in_process(tool, argv[:3] + [str(out / "x")] + argv[4:], capsys)[0] == 0
    earlier = read_bytes(str(out / "x_text_document"))
    before = {name: sorted(os.listdir(name)) for name in (tmp_path, out)}
    if inject is not None:
        inject(monkeypatch, out)

    status, err = run_in_process(tool, argv, capsys)

    monkeypatch.undo()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert status == 1 and len(errors) == 1 and errors[0] == err.strip().splitlines()[-1], err
    assert "Traceback" not in err
    assert message.format(out=out, tmp=tmp_path) in errors[0] and CAUSES.get(fault, "") in errors[0], errors[0]
    assert {name: sorted(os.listdir(name)) for name in (tmp_path, out)} == before
    assert read_bytes(str(out / "x_text_document")) == earlier
