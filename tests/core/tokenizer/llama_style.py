"""Llama-style tokenizer files for tests, built from the sample corpus in about a second.

* ``write_llama3_style``: Llama 3's layout: a byte-level BPE tokenizer.json (here from the GPT-2
  vocab/merges fixture) with ``<|begin_of_text|>`` / ``<|end_of_text|>`` as added special tokens and
  a post-processor that puts ``<|begin_of_text|>`` before every sequence.
* ``write_llama2_style``: Llama 2's layout: a SentencePiece-style BPE (``▁`` for spaces) trained by
  ``tokenizers``, ``<s>``/``</s>``, with a tokenizer_config.json saying ``add_bos_token``.
* ``train_sentencepiece``: a SentencePiece BPE ``.model`` (bos 1, eos 2, byte fallback).
"""
import gzip
import io
import json
import os

from tests.conftest import SAMPLE_CORPUS

LLAMA3_BOS, LLAMA3_EOS = "<|begin_of_text|>", "<|end_of_text|>"
# Llama 3's pre-tokenization (its tokenizer.json's Split regex).
LLAMA3_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                        r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def corpus_texts(limit=None):
    """The sample corpus' documents (the first ``limit``)."""
    with gzip.open(SAMPLE_CORPUS, "rt", encoding="utf-8") as handle:
        return [json.loads(line)["text"] for _, line in zip(range(limit or 1 << 62), handle)]


def corpus_lines(limit=20000):
    """Non-blank lines of the corpus (SentencePiece trains on sentences of at most 4 kB)."""
    lines = [line for text in corpus_texts() for line in text.split("\n") if line.strip()]
    return lines[:limit]


def write_config(directory, **config):
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle)


def write_llama3_style(directory, vocab_file, merge_file, with_config=True, llama3_split=False):
    """A Llama 3 style tokenizer.json (+ tokenizer_config.json) in ``directory``; returns it.
    ``llama3_split``: Llama 3's Split regex + ByteLevel and ``ignore_merges``, else GPT-2's ByteLevel."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    from megatron.core.tokenizer.bpe_files import read_merge_file
    with open(vocab_file, encoding="utf-8") as handle:
        vocab = json.load(handle)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=read_merge_file(merge_file), ignore_merges=llama3_split))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if llama3_split:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([LLAMA3_BOS, LLAMA3_EOS])
    bos_id = tokenizer.token_to_id(LLAMA3_BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{LLAMA3_BOS} $A", pair=f"{LLAMA3_BOS} $A {LLAMA3_BOS} $B", special_tokens=[(LLAMA3_BOS, bos_id)])
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    if with_config:
        write_config(directory, tokenizer_class="PreTrainedTokenizerFast", bos_token=LLAMA3_BOS,
                     eos_token=LLAMA3_EOS)
    return str(directory)


def write_llama2_style(directory, vocab_size=2000):
    """A Llama 2 style tokenizer.json + tokenizer_config.json (add_bos_token) in ``directory``."""
    from tokenizers import SentencePieceBPETokenizer, processors

    tokenizer = SentencePieceBPETokenizer()
    tokenizer.train_from_iterator(corpus_lines(), vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    write_config(directory, tokenizer_class="PreTrainedTokenizerFast", add_bos_token=True, add_eos_token=False,
                 bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return str(directory)


def train_sentencepiece(model_file, vocab_size=2000, **options):
    """Train a SentencePiece BPE model on the corpus' lines into ``model_file``; returns its path."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(corpus_lines()), model_writer=model,
                                             vocab_size=vocab_size, model_type="bpe", byte_fallback=True,
                                             minloglevel=2, **options)
    with open(model_file, "wb") as handle:
        handle.write(model.getvalue())
    return str(model_file)
