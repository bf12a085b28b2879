"""Preprocessing with the tokenizers of Llama-class models: every document starts with the
tokenizer's BOS and is the library's own encoding (+ eod with --append-eod), in both tools; bad
tokenizer files are one line and leave nothing on disk."""
import json
import os
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer

from megatron.core.data.indexed_dataset import MMapIndexedDataset
from megatron.core.tokenizer import build_tokenizer
from tests.core.data.test_preprocessing import punkt_data_dir, use_punkt  # noqa: F401
from tests.core.tokenizer.llama_style import corpus_texts, train_sentencepiece, write_llama3_style
from tests.tools.test_preprocess_data import read_bytes, run_in_process
from tools.preprocess_data import preprocess
from tools.preprocess_data_many_cores import preprocess_many_cores

TEXTS = corpus_texts(120)


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
    return str(path)


@pytest.fixture(scope="module")
def llama3_dir(gpt2_tokenizer_files, tmp_path_factory):
    return write_llama3_style(tmp_path_factory.mktemp("llama3"), *gpt2_tokenizer_files)


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    pytest.importorskip("sentencepiece")
    return train_sentencepiece(tmp_path_factory.mktemp("spm") / "tokenizer.model", vocab_size=1000)


def documents(prefix):
    dataset = MMapIndexedDataset(prefix)
    return [np.concatenate([dataset[i] for i in range(start, stop)]).tolist()
            for start, stop in zip(dataset.doc_idx[:-1], dataset.doc_idx[1:])]


def test_hf_tokenizer_documents_are_the_library_encoding(tmp_path, small_corpus, llama3_dir, capsys):
    prefix = str(tmp_path / "hf")
    status, err = run_in_process(preprocess, ["--input", small_corpus, "--output-prefix", prefix, "--append-eod",
                                              "--tokenizer-type", "HuggingFaceTokenizer",
                                              "--tokenizer-model", os.path.join(llama3_dir, "tokenizer.json")],
                                 capsys)
    assert status == 0, err
    library = Tokenizer.from_file(os.path.join(llama3_dir, "tokenizer.json"))
    expected = [encoding.ids + [4097] for encoding in library.encode_batch(TEXTS)]  # <|begin_of_text|> ... eos
    assert expected[0][0] == 4096
    assert documents(prefix + "_text_document") == expected
    assert "4098 tokens, padded to 4224" in err


@pytest.mark.distributed
def test_sentencepiece_many_cores_equals_serial_and_sentencepiece(tmp_path, small_corpus, sentencepiece_model,
                                                                  capsys):
    import sentencepiece

    flags = ["--input", small_corpus, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
             sentencepiece_model, "--chunk-size", "16"]
    status, err = run_in_process(preprocess, flags + ["--output-prefix", str(tmp_path / "serial")], capsys)
    assert status == 0, err
    status, err = run_in_process(preprocess_many_cores, flags + ["--output-prefix", str(tmp_path / "many"),
                                                                 "--workers", "2"], capsys)
    assert status == 0, err
    expected = sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model).encode(TEXTS, add_bos=True)
    assert documents(str(tmp_path / "serial_text_document")) == expected
    assert read_bytes(str(tmp_path / "many_text_document")) == read_bytes(str(tmp_path / "serial_text_document"))


def test_split_sentences_put_the_bos_before_the_first_sentence_only(tmp_path, small_corpus, llama3_dir,
                                                                    use_punkt, capsys):  # noqa: F811
    prefix = str(tmp_path / "sentences")
    status, err = run_in_process(preprocess, ["--input", small_corpus, "--output-prefix", prefix, "--append-eod",
                                              "--split-sentences", "--keep-newlines", "--tokenizer-type",
                                              "HuggingFaceTokenizer", "--tokenizer-model", llama3_dir], capsys)
    assert status == 0, err
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=llama3_dir)
    dataset = MMapIndexedDataset(prefix + "_text_sentence")
    assert len(dataset) > 2 * len(TEXTS)
    for document, text in zip(documents(prefix + "_text_sentence"), TEXTS):
        assert document[0] == tokenizer.bos and document.count(tokenizer.bos) == 1
        assert document[-1] == tokenizer.eod and tokenizer.detokenize(document[1:-1]) == text.rstrip()
    first_items = dataset.doc_idx[:-1]
    assert all(dataset[int(i)][0] == tokenizer.bos for i in first_items)


def test_bad_tokenizer_files_are_one_line_and_write_nothing(tmp_path, small_corpus, sentencepiece_model, capsys,
                                                            monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    garbage = tmp_path / "tokenizer.json"
    garbage.write_text('{"version": "1.0", "model": 3}')
    cases = [(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(garbage)],
              f"error: --tokenizer-model {garbage}: not a tokenizer.json the tokenizers package can load"),
             (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(garbage)],
              f"error: --tokenizer-model {garbage}: not a SentencePiece model that loads"),
             (["--tokenizer-type", "HuggingFaceTokenizer"], "error: --tokenizer-type HuggingFaceTokenizer needs "
                                                            "--tokenizer-model")]
    for flags, message in cases:
        status, err = run_in_process(preprocess, ["--input", small_corpus, "--output-prefix", str(out / "x")]
                                     + flags, capsys)
        assert status == 1 and err.strip().startswith(message) and len(err.strip().splitlines()) == 1, err
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    status, err = run_in_process(preprocess_many_cores, ["--input", small_corpus, "--output-prefix", str(out / "x"),
                                                         "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
                                                         sentencepiece_model, "--workers", "2"], capsys)
    assert status == 1 and "needs the sentencepiece package: pip install .[sentencepiece]" in err
    assert os.listdir(out) == []
