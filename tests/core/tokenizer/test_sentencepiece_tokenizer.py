"""SentencePieceTokenizer: ids equal to sentencepiece's encode, Llama's BOS/EOS, the optional
package, and models that do not load or have no eos."""
import pickle
import sys

import pytest

from megatron.core.tokenizer import SENTENCEPIECE_TYPES, TokenizerError, build_tokenizer, prompt_tokens
from tests.core.tokenizer.llama_style import corpus_texts, train_sentencepiece

sentencepiece = pytest.importorskip("sentencepiece")
TEXTS = corpus_texts(150)


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    """A Llama-like SentencePiece BPE: <unk> 0, <s> 1, </s> 2, byte fallback, no normalization."""
    return train_sentencepiece(tmp_path_factory.mktemp("spm") / "tokenizer.model",
                               normalization_rule_name="identity", remove_extra_whitespaces=False)


@pytest.mark.parametrize("tokenizer_type", SENTENCEPIECE_TYPES)
def test_ids_equal_sentencepiece_encode(sentencepiece_model, tokenizer_type):
    reference = sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model)
    tokenizer = build_tokenizer(tokenizer_type, tokenizer_model=sentencepiece_model)
    assert (tokenizer.bos, tokenizer.eod, tokenizer.vocab_size) == (1, 2, 2000)
    expected = reference.encode(TEXTS, add_bos=True)
    assert [[tokenizer.bos] + ids for ids in tokenizer.tokenize_batch(TEXTS)] == expected
    assert [tokenizer.tokenize(text) for text in TEXTS[:20]] == [ids[1:] for ids in expected[:20]]
    assert tokenizer.tokenize_batch([]) == []
    for text, ids in zip(TEXTS[:30], expected):
        assert tokenizer.detokenize(ids[1:]) == reference.decode(ids[1:]) == text
    assert tokenizer.inv_vocab[1] == "<s>" and tokenizer.vocab["</s>"] == 2
    assert prompt_tokens(tokenizer, "def f():") == reference.encode("def f():", add_bos=True)
    assert pickle.loads(pickle.dumps(tokenizer)).tokenize(TEXTS[0]) == expected[0][1:]


def test_model_without_bos_has_none(tmp_path):
    model = train_sentencepiece(tmp_path / "no_bos.model", vocab_size=1000, bos_id=-1)
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    assert tokenizer.bos is None and tokenizer.eod == 2
    assert prompt_tokens(tokenizer, "") == [2]


def test_bad_models_are_one_clear_error(tmp_path):
    def refused(match, model=None, tokenizer_type="SentencePieceTokenizer"):
        with pytest.raises(TokenizerError, match=match):
            build_tokenizer(tokenizer_type, tokenizer_model=model)

    refused("--tokenizer-type SentencePieceTokenizer needs --tokenizer-model")
    refused(f"--tokenizer-model {tmp_path}/missing.model: no such file", str(tmp_path / "missing.model"))
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"\x00not a protobuf\xff" * 10)
    refused(f"--tokenizer-model {garbage}: not a SentencePiece model that loads", str(garbage))
    no_eos = train_sentencepiece(tmp_path / "no_eos.model", vocab_size=1000, eos_id=-1)
    refused(f"--tokenizer-model {no_eos}: the SentencePiece model has no eos piece", no_eos, "Llama2Tokenizer")


def test_missing_package_names_the_extra(sentencepiece_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    with pytest.raises(TokenizerError, match=r"Llama2Tokenizer needs the sentencepiece package: "
                                             r"pip install \.\[sentencepiece\]"):
        build_tokenizer("Llama2Tokenizer", tokenizer_model=sentencepiece_model)
