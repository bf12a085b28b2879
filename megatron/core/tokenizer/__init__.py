"""Tokenizers: GPT-2 byte-level BPE, Hugging Face tokenizer.json, SentencePiece, PretrainedFromHF.

    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=..., merge_file=...)
    ids = tok.tokenize(text); text == tok.detokenize(ids); tok.eod; tok.bos; tok.vocab_size
    padded = vocab_size_with_padding(tok.vocab_size, 128, tensor_model_parallel_size)

Every tokenizer's ``tokenize`` gives the ids of the text alone (no special token); ``bos`` is the
id its library puts before a sequence (Llama's ``<s>``, ``<|begin_of_text|>``) or None (GPT-2);
``eod`` ends a document. Documents (in preprocessing) and prompts (``prompt_tokens``) start with
``bos`` where there is one, which reproduces the library's own encoding.

GPT-2 BPE and byte-level tokenizer.json files: the tiktoken fast path is used when it reproduces
the reference ids (``tok.is_fast``, ``tok.fast_path_reason``). ``use_fast=False`` or the environment
variable ``MEGATRON_TOKENIZER_FAST=0`` (when ``use_fast`` is None) forces the regex reference (the
``tokenizers`` library for a tokenizer.json).
"""
import importlib.util
import os

from megatron.core.tokenizer.gpt2_bpe import FAST_ENV_VAR, GPT2BPETokenizer, TokenizerError
from megatron.core.tokenizer.hf_pretrained import PretrainedFromHF
from megatron.core.tokenizer.hf_tokenizer import TOKENIZER_FILE, HuggingFaceTokenizer
from megatron.core.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer
from megatron.core.tokenizer.vocab_padding import vocab_size_with_padding

# Megatron-LM's names of SentencePiece with GPT semantics (eod = the model's eos, nothing added).
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
SUPPORTED_TOKENIZER_TYPES = ("GPT2BPETokenizer", "PretrainedFromHF", "HuggingFaceTokenizer") + SENTENCEPIECE_TYPES
REJECTED_TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase")

__all__ = ["FAST_ENV_VAR", "GPT2BPETokenizer", "HuggingFaceTokenizer", "PretrainedFromHF",
           "SENTENCEPIECE_TYPES", "SUPPORTED_TOKENIZER_TYPES", "SentencePieceTokenizer", "TokenizerError",
           "bos_of", "build_tokenizer", "prompt_tokens", "vocab_size_with_padding", "with_bos"]


def bos_of(tokenizer):
    """The id put before each document and prompt, or None (a tokenizer without ``bos`` has none)."""
    return getattr(tokenizer, "bos", None)


def with_bos(tokenizer, ids):
    """``[bos] + ids`` where the tokenizer has a BOS, else ``ids`` (a new list either way)."""
    bos = bos_of(tokenizer)
    return list(ids) if bos is None else [bos] + list(ids)


def prompt_tokens(tokenizer, text):
    """The ids a generation continues: ``with_bos(tokenize(text))``; a prompt without tokens starts
    from the BOS, or from ``eod`` (GPT-2's unconditional sample)."""
    return with_bos(tokenizer, tokenizer.tokenize(text) if text else []) or [tokenizer.eod]


def _hf_tokenizer(tokenizer_model, tokenizer_name_or_path, use_fast):
    if tokenizer_model:
        return HuggingFaceTokenizer(tokenizer_model, flag="--tokenizer-model", use_fast=use_fast)
    if tokenizer_name_or_path:
        return HuggingFaceTokenizer(tokenizer_name_or_path, flag="--tokenizer-name-or-path", use_fast=use_fast)
    raise TokenizerError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json, or "
                         "a directory holding one) or --tokenizer-name-or-path (a directory)")


def _pretrained_from_hf(tokenizer_name_or_path, use_fast):
    """transformers' AutoTokenizer; without transformers, a directory's tokenizer.json is read by
    HuggingFaceTokenizer (same ids for a fast tokenizer)."""
    if not tokenizer_name_or_path:
        raise TokenizerError("--tokenizer-type PretrainedFromHF needs "
                             "--tokenizer-name-or-path (a local tokenizer directory)")
    if (importlib.util.find_spec("transformers") is None
            and os.path.isfile(os.path.join(tokenizer_name_or_path, TOKENIZER_FILE))):
        return HuggingFaceTokenizer(tokenizer_name_or_path, flag="--tokenizer-name-or-path", use_fast=use_fast)
    return PretrainedFromHF(tokenizer_name_or_path, use_fast=use_fast)


def build_tokenizer(tokenizer_type, vocab_file=None, merge_file=None,
                    tokenizer_name_or_path=None, use_fast=None, tokenizer_model=None):
    """Build the tokenizer named by ``--tokenizer-type``.

    GPT2BPETokenizer needs ``vocab_file`` and ``merge_file`` (--vocab-file, --merge-file);
    PretrainedFromHF needs ``tokenizer_name_or_path`` (--tokenizer-name-or-path, a local
    directory); HuggingFaceTokenizer ``tokenizer_model`` (--tokenizer-model, a tokenizer.json or
    its directory) or ``tokenizer_name_or_path``; the SentencePiece types ``tokenizer_model`` (a
    ``.model`` file). Megatron-DeepSpeed's BERT word-piece types are not supported.
    """
    if tokenizer_type == "GPT2BPETokenizer":
        if not vocab_file or not merge_file:
            raise TokenizerError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and "
                                 "--merge-file")
        return GPT2BPETokenizer(vocab_file, merge_file, use_fast=use_fast)
    if tokenizer_type == "PretrainedFromHF":
        return _pretrained_from_hf(tokenizer_name_or_path, use_fast)
    if tokenizer_type == "HuggingFaceTokenizer":
        return _hf_tokenizer(tokenizer_model, tokenizer_name_or_path, use_fast)
    if tokenizer_type in SENTENCEPIECE_TYPES:
        if not tokenizer_model:
            raise TokenizerError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model (a SentencePiece "
                                 f".model file)")
        return SentencePieceTokenizer(tokenizer_model, tokenizer_type)
    if tokenizer_type in REJECTED_TOKENIZER_TYPES:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} is not supported (BERT "
                             f"tokenizers are out of scope); use one of "
                             f"{', '.join(SUPPORTED_TOKENIZER_TYPES)}")
    raise TokenizerError(f"--tokenizer-type {tokenizer_type!r} is unknown; use one of "
                         f"{', '.join(SUPPORTED_TOKENIZER_TYPES)}")
