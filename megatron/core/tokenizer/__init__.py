"""Tokenizers: GPT-2 byte-level BPE (regex reference + compiled fast path) and PretrainedFromHF.

    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=..., merge_file=...)
    ids = tok.tokenize(text); text == tok.detokenize(ids); tok.eod; tok.vocab_size
    padded = vocab_size_with_padding(tok.vocab_size, 128, tensor_model_parallel_size)

The fast path is used when it reproduces the reference ids (``tok.is_fast``,
``tok.fast_path_reason``). ``use_fast=False`` or the environment variable
``MEGATRON_TOKENIZER_FAST=0`` (when ``use_fast`` is None) forces the regex reference.
"""
from megatron.core.tokenizer.gpt2_bpe import FAST_ENV_VAR, GPT2BPETokenizer, TokenizerError
from megatron.core.tokenizer.hf_pretrained import PretrainedFromHF
from megatron.core.tokenizer.vocab_padding import vocab_size_with_padding

SUPPORTED_TOKENIZER_TYPES = ("GPT2BPETokenizer", "PretrainedFromHF")
REJECTED_TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase")

__all__ = ["FAST_ENV_VAR", "GPT2BPETokenizer", "PretrainedFromHF", "SUPPORTED_TOKENIZER_TYPES",
           "TokenizerError", "build_tokenizer", "vocab_size_with_padding"]


def build_tokenizer(tokenizer_type, vocab_file=None, merge_file=None,
                    tokenizer_name_or_path=None, use_fast=None):
    """Build the tokenizer named by ``--tokenizer-type``.

    GPT2BPETokenizer needs ``vocab_file`` and ``merge_file`` (--vocab-file, --merge-file);
    PretrainedFromHF needs ``tokenizer_name_or_path`` (--tokenizer-name-or-path, a local
    directory). Megatron-DeepSpeed's BERT word-piece types are not supported.
    """
    if tokenizer_type == "GPT2BPETokenizer":
        if not vocab_file or not merge_file:
            raise TokenizerError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and "
                                 "--merge-file")
        return GPT2BPETokenizer(vocab_file, merge_file, use_fast=use_fast)
    if tokenizer_type == "PretrainedFromHF":
        if not tokenizer_name_or_path:
            raise TokenizerError("--tokenizer-type PretrainedFromHF needs "
                                 "--tokenizer-name-or-path (a local tokenizer directory)")
        return PretrainedFromHF(tokenizer_name_or_path, use_fast=use_fast)
    if tokenizer_type in REJECTED_TOKENIZER_TYPES:
        raise TokenizerError(f"--tokenizer-type {tokenizer_type} is not supported (BERT "
                             f"tokenizers are out of scope); use one of "
                             f"{', '.join(SUPPORTED_TOKENIZER_TYPES)}")
    raise TokenizerError(f"--tokenizer-type {tokenizer_type!r} is unknown; use one of "
                         f"{', '.join(SUPPORTED_TOKENIZER_TYPES)}")
