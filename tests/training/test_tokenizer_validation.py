"""Trainer flag validation of the Llama-class tokenizers: the file flag each type needs and the
sentencepiece extra, refused before any work with a message naming the flag or the install."""
import importlib.util

import pytest

from tests.training.test_arguments import error, parse


@pytest.mark.parametrize("tokenizer_type", ["SentencePieceTokenizer", "Llama2Tokenizer", "HuggingFaceTokenizer"])
def test_file_flag_is_required(tokenizer_type):
    assert "--tokenizer-model" in error(["--tokenizer-type", tokenizer_type])


def test_given_files_are_accepted():
    flags = parse(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/tok/tokenizer.json"]).flags
    assert (flags.tokenizer_type, flags.tokenizer_model) == ("HuggingFaceTokenizer", "/tok/tokenizer.json")
    assert parse(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-name-or-path", "/tok"]).flags
    assert parse(["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "/tok/tokenizer.model"]).flags


def test_missing_sentencepiece_names_the_extra(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "sentencepiece" else real_find_spec(name, *args))
    message = error(["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "/tok/tokenizer.model"])
    assert "--tokenizer-type Llama2Tokenizer needs the sentencepiece package: pip install .[sentencepiece]" in message
