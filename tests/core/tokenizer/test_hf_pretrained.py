"""PretrainedFromHF: offline load of a local directory, ids equal to GPT2BPETokenizer, errors."""
import gzip
import json
import pickle

import pytest

from megatron.core.tokenizer import TokenizerError, build_tokenizer
from megatron.core.tokenizer.gpt2_bpe import EOD_TOKEN, read_merge_file

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_tokenizer_dir(gpt2_tokenizer_files, tmp_path_factory):
    """A transformers tokenizer directory built from our own vocab.json/merges.txt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab_file, merge_file = gpt2_tokenizer_files
    with open(vocab_file, encoding="utf-8") as handle:
        vocab = json.load(handle)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=read_merge_file(merge_file)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOD_TOKEN)
    directory = tmp_path_factory.mktemp("hf_tokenizer")
    tokenizer.save_pretrained(str(directory))
    return str(directory)


def test_local_directory_loads_offline(hf_tokenizer_dir, gpt2_tokenizer_files, sample_corpus,
                                       monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=hf_tokenizer_dir)
    gpt2 = build_tokenizer("GPT2BPETokenizer", *gpt2_tokenizer_files)
    assert tokenizer.vocab_size == gpt2.vocab_size == 4096
    assert tokenizer.eod == gpt2.eod == 4095
    assert tokenizer.is_fast and tokenizer.vocab[EOD_TOKEN] == 4095
    assert tokenizer.inv_vocab[4095] == EOD_TOKEN
    with gzip.open(sample_corpus, "rt", encoding="utf-8") as handle:
        texts = [json.loads(line)["text"] for _, line in zip(range(200), handle)]
    ids = tokenizer.tokenize_batch(texts)
    assert ids == gpt2.tokenize_batch(texts)
    assert ids[:20] == [tokenizer.tokenize(text) for text in texts[:20]]
    for text, text_ids in zip(texts, ids):
        assert tokenizer.detokenize(text_ids) == text
    assert tokenizer.tokenize_batch([]) == []
    assert pickle.loads(pickle.dumps(tokenizer)).tokenize(texts[0]) == ids[0]


@pytest.mark.parametrize("name", ["no-such-org/no-such-model-x9", "/nonexistent/tokenizer/dir"])
def test_unloadable_tokenizer_is_a_clear_error(name, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TokenizerError, match=f"--tokenizer-name-or-path {name}: cannot load"):
        build_tokenizer("PretrainedFromHF", tokenizer_name_or_path=name)


def test_missing_path_flag():
    with pytest.raises(TokenizerError, match="needs --tokenizer-name-or-path"):
        build_tokenizer("PretrainedFromHF")
