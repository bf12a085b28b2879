"""tools/train_tokenizer.py: GPT-2 layout of the output, determinism, inputs, errors."""
import gzip
import json
import lzma
import os
import subprocess
import sys

import pytest

from megatron.core.tokenizer import build_tokenizer
from megatron.core.tokenizer.gpt2_bpe import EOD_TOKEN, bytes_to_unicode, read_merge_file
from tests.conftest import REPO_ROOT
from tests.disk_faults import full_disk, read_only
from tools.train_tokenizer import TrainTokenizerError, gpt2_layout_vocab, main, train_tokenizer

TOOL = os.path.join(REPO_ROOT, "tools", "train_tokenizer.py")


def load_vocab(vocab_file):
    with open(vocab_file, encoding="utf-8") as handle:
        return json.load(handle)


def test_gpt2_layout(gpt2_tokenizer_files):
    vocab_file, merge_file = gpt2_tokenizer_files
    vocab = load_vocab(vocab_file)
    merges = read_merge_file(merge_file)
    with open(merge_file, encoding="utf-8") as handle:
        assert handle.readline() == "#version: 0.2\n"
    assert len(vocab) == 4096 and len(merges) == 4096 - 257
    assert sorted(vocab.values()) == list(range(4096))
    byte_chars = list(bytes_to_unicode().values())
    assert [vocab[char] for char in byte_chars] == list(range(256))
    assert vocab["!"] == 0 and vocab["Ġ"] == 220 and vocab["Ċ"] == 198
    assert [vocab[left + right] for left, right in merges] == list(range(256, 4095))
    assert vocab[EOD_TOKEN] == 4095
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file, merge_file)
    assert tokenizer.fast_path_reason == "tiktoken (ids = ranks)"
    assert tokenizer.eod == 4095


def test_layout_with_a_repeated_merge_result():
    """HF's trainer may learn two pairs with one result: the token keeps its first id."""
    merges = [("a", "b"), ("b", "c"), ("ab", "c"), ("a", "bc"), ("abc", "d")]
    vocab = gpt2_layout_vocab(merges)
    assert len(vocab) == 261
    assert [vocab[token] for token in ("ab", "bc", "abc", "abcd", EOD_TOKEN)] == \
        [256, 257, 258, 259, 260]


def test_deterministic_across_processes(gpt2_tokenizer_files, sample_corpus, tmp_path):
    """A second run, in a new process (new hash seeds), writes the same bytes."""
    result = subprocess.run([sys.executable, TOOL, "--input", sample_corpus, "--vocab-size", "4096",
                             "--output-dir", str(tmp_path)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONHASHSEED": "12345"}, check=True)
    assert f"wrote {tmp_path / 'vocab.json'} (4096 tokens, <|endoftext|> = 4095)" in result.stdout
    assert f"wrote {tmp_path / 'merges.txt'} (3839 merges)" in result.stdout
    for produced, expected in zip((tmp_path / "vocab.json", tmp_path / "merges.txt"),
                                  gpt2_tokenizer_files):
        with open(expected, "rb") as handle:
            assert produced.read_bytes() == handle.read()
    assert sorted(os.listdir(tmp_path)) == ["merges.txt", "vocab.json"]


def write_jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as handle:
        for record in records:
            handle.write(record if isinstance(record, str) else json.dumps(record))
            handle.write("\n")


def test_inputs_compressed_globs_keys_and_bad_lines(tmp_path, capsys):
    words = ["alpha beta gamma", "delta epsilon", "zeta eta theta iota"]
    write_jsonl(tmp_path / "a.jsonl", [{"text": w, "title": w.upper()} for w in words])
    write_jsonl(tmp_path / "b.jsonl.gz", [{"text": w * 2, "title": "X"} for w in words], gzip.open)
    write_jsonl(tmp_path / "c.jsonl.xz", [{"text": w * 3, "title": "Y"} for w in words], lzma.open)
    write_jsonl(tmp_path / "d.jsonl", ['{"text": "ok", "title": "T"}', "{not json", '[1, 2]',
                                       '{"text": 7, "title": "U"}', '{"title": "V"}', ""])
    out = tmp_path / "out"
    code = main(["--input", str(tmp_path / "*.jsonl*"), "--json-keys", "text", "title",
                 "--vocab-size", "300", "--output-dir", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    # 9 good lines x 2 keys, plus the good keys of d.jsonl (ok, T, U, V); its other 6 are bad.
    assert "trained on 22 documents" in printed
    assert "skipped 6 bad records, first at" in printed and "d.jsonl:2 (text)" in printed
    vocab = load_vocab(out / "vocab.json")
    assert len(vocab) == 300 and vocab[EOD_TOKEN] == 299
    tokenizer = build_tokenizer("GPT2BPETokenizer", str(out / "vocab.json"),
                                str(out / "merges.txt"))
    assert tokenizer.is_fast
    assert tokenizer.detokenize(tokenizer.tokenize("gamma delta ZETA")) == "gamma delta ZETA"


def test_small_corpus_stops_early_and_says_so(tmp_path, capsys):
    write_jsonl(tmp_path / "tiny.jsonl", [{"text": "ab ab abc"}])
    assert main(["--input", str(tmp_path / "tiny.jsonl"), "--output-dir", str(tmp_path / "o")]) == 0
    printed = capsys.readouterr().out
    vocab = load_vocab(tmp_path / "o" / "vocab.json")
    assert f"the vocabulary has {len(vocab)} tokens instead of 50257" in printed
    assert vocab[EOD_TOKEN] == len(vocab) - 1 and len(vocab) < 270


def test_errors(tmp_path, capsys):
    write_jsonl(tmp_path / "x.jsonl", [{"body": "no text key"}])
    with pytest.raises(TrainTokenizerError, match="--vocab-size 100: must be at least 257"):
        train_tokenizer([str(tmp_path / "x.jsonl")], str(tmp_path / "o"), vocab_size=100)
    with pytest.raises(TrainTokenizerError, match="no document with keys \\['text'\\]"):
        train_tokenizer([str(tmp_path / "x.jsonl")], str(tmp_path / "o"), vocab_size=300)
    assert main(["--input", str(tmp_path / "none*.jsonl"), "--output-dir", str(tmp_path)]) == 2
    assert "matches no file" in capsys.readouterr().err
    with pytest.raises(TrainTokenizerError, match="missing.jsonl: no such file"):
        train_tokenizer([str(tmp_path / "missing.jsonl")], str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("fault", ["read-only", "full", "a file in the way"])
def test_an_unwritable_output_dir_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys, fault):
    """The tokenizer files an earlier run wrote stay as they were; no temporary file is left."""
    write_jsonl(tmp_path / "x.jsonl", [{"text": "alpha beta gamma delta " * 20}])
    out = tmp_path / "out"
    argv = ["--input", str(tmp_path / "x.jsonl"), "--vocab-size", "300", "--output-dir", str(out)]
    assert main(argv) == 0
    earlier = {name: (out / name).read_bytes() for name in os.listdir(out)}
    capsys.readouterr()
    if fault == "read-only":
        read_only(monkeypatch, out)
    elif fault == "full":
        full_disk(monkeypatch, out, capacity=1024)
    else:
        argv[-1] = str(tmp_path / "x.jsonl")
    status = main(argv)
    monkeypatch.undo()
    err = capsys.readouterr().err
    cause = {"read-only": "Read-only file system", "full": "No space left on device",
             "a file in the way": "File exists"}[fault]
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: --output-dir {argv[-1]}: cannot write ") and err.strip().endswith(cause), err
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == earlier
