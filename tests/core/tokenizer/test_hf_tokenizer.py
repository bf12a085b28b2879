"""HuggingFaceTokenizer (tokenizer.json through ``tokenizers``): ids equal to the library's and to
transformers', the BOS / eod of Llama 2 and Llama 3 layouts, PretrainedFromHF's BOS, and bad files."""
import importlib.util
import json
import os
import pickle

import pytest
from tokenizers import Tokenizer

from megatron.core.tokenizer import (HuggingFaceTokenizer, PretrainedFromHF, TokenizerError, build_tokenizer,
                                     prompt_tokens)
from tests.core.tokenizer.llama_style import (LLAMA3_BOS, LLAMA3_EOS, corpus_texts, write_config,
                                              write_llama2_style, write_llama3_style)

TEXTS = corpus_texts(150)
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@pytest.fixture(scope="module")
def llama3_dir(gpt2_tokenizer_files, tmp_path_factory):
    return write_llama3_style(tmp_path_factory.mktemp("llama3"), *gpt2_tokenizer_files)


@pytest.fixture(scope="module")
def llama2_dir(tmp_path_factory):
    return write_llama2_style(tmp_path_factory.mktemp("llama2"))


def library_ids(directory, texts):
    """The ``tokenizers`` library's own encoding, special tokens included."""
    library = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    return [encoding.ids for encoding in library.encode_batch(texts)]


def assert_documents_equal_reference(tokenizer, reference_ids):
    documents = [[tokenizer.bos] + ids for ids in tokenizer.tokenize_batch(TEXTS)]
    assert documents == reference_ids
    assert [tokenizer.tokenize(text) for text in TEXTS[:20]] == [ids[1:] for ids in reference_ids[:20]]


@pytest.mark.parametrize("layout", ["llama3", "llama2"])
def test_ids_equal_the_tokenizers_library(layout, request):
    directory = request.getfixturevalue(f"{layout}_dir")
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=os.path.join(directory, "tokenizer.json"))
    assert_documents_equal_reference(tokenizer, library_ids(directory, TEXTS))
    assert tokenizer.tokenize_batch([]) == []
    assert pickle.loads(pickle.dumps(tokenizer)).tokenize(TEXTS[0]) == tokenizer.tokenize(TEXTS[0])


def test_llama3_layout_special_tokens(llama3_dir):
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=llama3_dir)
    assert (tokenizer.bos, tokenizer.eod, tokenizer.vocab_size) == (4096, 4097, 4098)
    assert tokenizer.inv_vocab[tokenizer.bos] == LLAMA3_BOS and tokenizer.vocab[LLAMA3_EOS] == tokenizer.eod
    for text in TEXTS[:30]:
        assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    assert tokenizer.detokenize([tokenizer.bos, *tokenizer.tokenize("Hi")]) == LLAMA3_BOS + "Hi"
    assert prompt_tokens(tokenizer, "Hi") == [4096] + tokenizer.tokenize("Hi")
    assert prompt_tokens(tokenizer, "") == [4096]


def test_llama2_layout_reads_its_config(llama2_dir):
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_name_or_path=llama2_dir)
    assert (tokenizer.bos, tokenizer.eod, tokenizer.vocab_size) == (1, 2, 2000)
    write_config(llama2_dir, add_bos_token=False, bos_token="<s>", eos_token="</s>")
    try:
        assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=llama2_dir).bos is None
    finally:
        write_llama2_style(llama2_dir)


def test_without_config_the_post_processor_and_known_eos_decide(gpt2_tokenizer_files, tmp_path):
    directory = write_llama3_style(tmp_path / "bare", *gpt2_tokenizer_files, with_config=False)
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=directory)
    assert (tokenizer.bos, tokenizer.eod) == (4096, 4097)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
@pytest.mark.parametrize("layout", ["llama3", "llama2"])
def test_documents_equal_transformers_encode(layout, request):
    from transformers import AutoTokenizer

    directory = request.getfixturevalue(f"{layout}_dir")
    reference = AutoTokenizer.from_pretrained(directory)
    expected = reference(TEXTS)["input_ids"]
    assert_documents_equal_reference(build_tokenizer("HuggingFaceTokenizer", tokenizer_model=directory), expected)
    pretrained = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=directory)
    assert isinstance(pretrained, PretrainedFromHF)
    assert (pretrained.bos, pretrained.eod) == (reference.bos_token_id, reference.eos_token_id)
    assert_documents_equal_reference(pretrained, expected)


def test_pretrained_from_hf_without_transformers_reads_tokenizer_json(llama3_dir, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "transformers" else real_find_spec(name, *args))
    tokenizer = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=llama3_dir)
    assert isinstance(tokenizer, HuggingFaceTokenizer) and (tokenizer.bos, tokenizer.eod) == (4096, 4097)


def _no_eos_tokenizer_json(directory, llama3_dir):
    with open(os.path.join(llama3_dir, "tokenizer.json"), encoding="utf-8") as handle:
        spec = json.load(handle)
    spec["added_tokens"] = [token for token in spec["added_tokens"] if token["content"] != LLAMA3_EOS]
    spec["model"]["vocab"].pop("<|endoftext|>")
    spec["model"]["vocab"].pop(LLAMA3_EOS, None)
    os.makedirs(directory)
    path = os.path.join(directory, "tokenizer.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(spec, handle)
    return path


def test_bad_files_are_one_clear_error(llama3_dir, tmp_path):
    def refused(match, **paths):
        with pytest.raises(TokenizerError, match=match):
            build_tokenizer("HuggingFaceTokenizer", **paths)

    refused("--tokenizer-model .*missing.json: no such file", tokenizer_model=str(tmp_path / "missing.json"))
    refused(f"--tokenizer-name-or-path {tmp_path}: has no tokenizer.json", tokenizer_name_or_path=str(tmp_path))
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    refused(f"--tokenizer-model {garbage}: not a tokenizer.json the tokenizers package can load",
            tokenizer_model=str(garbage))
    no_eos = _no_eos_tokenizer_json(str(tmp_path / "no_eos"), llama3_dir)
    refused(f"--tokenizer-model {no_eos}: the tokenizer has no end-of-sequence token", tokenizer_model=no_eos)
    write_config(str(tmp_path / "no_eos"), eos_token="<|eot_id|>")
    refused("tokenizer_config.json's eos_token '<\\|eot_id\\|>' is not in the tokenizer's vocabulary",
            tokenizer_model=no_eos)
    (tmp_path / "no_eos" / "tokenizer_config.json").write_text("[1, 2")
    refused("tokenizer_config.json: not a readable JSON file", tokenizer_model=no_eos)
    refused("HuggingFaceTokenizer needs --tokenizer-model")


@pytest.fixture(scope="module")
def llama3_split_dir(gpt2_tokenizer_files, tmp_path_factory):
    return write_llama3_style(tmp_path_factory.mktemp("llama3_split"), *gpt2_tokenizer_files, llama3_split=True)


# Added tokens inside a text (the library splits them out), a character unassigned in Unicode
# (regex classes may differ between libraries), and plain text the compiled path encodes.
TRICKY_TEXTS = ["before <|end_of_text|> after <|begin_of_text|>x", "unassigned \U000e0fff here",
                "It's 12345 naïve 日本語 🙂\n\n  spaces\t", ""]


@pytest.mark.parametrize("layout", ["llama3", "llama3_split"])
def test_byte_level_files_take_the_tiktoken_path_with_the_library_ids(layout, request):
    directory = request.getfixturevalue(f"{layout}_dir")
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=directory)
    assert tokenizer.fast_path_reason == "tiktoken (checked equal to HF tokenizers)"
    library = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    expected = [encoding.ids for encoding in library.encode_batch(TEXTS + TRICKY_TEXTS, add_special_tokens=False)]
    assert tokenizer.tokenize_batch(TEXTS + TRICKY_TEXTS) == expected
    assert [tokenizer.tokenize(text) for text in TRICKY_TEXTS] == expected[len(TEXTS):]
    assert 4097 in expected[-4]  # <|end_of_text|> in the text is the added token, as the library has it


def test_other_files_use_the_library(llama2_dir):
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=llama2_dir)
    assert tokenizer.fast_path_reason.startswith("HF tokenizers (no tiktoken path: the pre-tokenizer is not "
                                                 "byte-level BPE's")
    library = Tokenizer.from_file(os.path.join(llama2_dir, "tokenizer.json"))
    assert tokenizer.tokenize_batch(TRICKY_TEXTS) == [encoding.ids for encoding in library.encode_batch(
        TRICKY_TEXTS, add_special_tokens=False)]


def test_the_tiktoken_path_can_be_switched_off(llama3_dir, monkeypatch):
    monkeypatch.setenv("MEGATRON_TOKENIZER_FAST", "0")
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=llama3_dir)
    assert tokenizer.fast_path_reason.startswith("HF tokenizers: tiktoken path switched off")
    fast = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=llama3_dir, use_fast=True)
    assert fast.fast_path_reason.startswith("tiktoken")
    assert tokenizer.tokenize_batch(TEXTS + TRICKY_TEXTS) == fast.tokenize_batch(TEXTS + TRICKY_TEXTS)


def test_an_nfc_normalizer_keeps_the_tiktoken_path(llama3_split_dir, tmp_path):
    with open(os.path.join(llama3_split_dir, "tokenizer.json"), encoding="utf-8") as handle:
        spec = json.load(handle)
    spec["normalizer"] = {"type": "NFC"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tokenizer.json"))
    assert tokenizer.fast_path_reason == "tiktoken (checked equal to HF tokenizers)"
    texts = TEXTS[:30] + TRICKY_TEXTS + ["cafe\u0301 and caf\u00e9", "\u212b ring"]  # NFC changes these two
    library = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.tokenize_batch(texts) == [encoding.ids for encoding in library.encode_batch(
        texts, add_special_tokens=False)]
    spec["normalizer"] = {"type": "NFKC"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    assert "NFKC normalizer" in build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path)).fast_path_reason
