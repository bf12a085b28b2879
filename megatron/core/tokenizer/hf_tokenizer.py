"""HuggingFaceTokenizer: a ``tokenizer.json`` read with the ``tokenizers`` package (no transformers).

The file is ``--tokenizer-model`` (a tokenizer.json, or a directory holding one, as Megatron-LM
passes a model directory) or ``--tokenizer-name-or-path`` (a directory). A ``tokenizer_config.json``
beside the tokenizer.json, when present, is read as transformers reads it: ``eos_token`` is the
end-of-document token, ``bos_token`` with ``add_bos_token`` says which BOS is added, if any.

Special tokens, the contract every tokenizer here keeps:
  * ``tokenize(text)`` gives the ids of the text alone, never a special token;
  * ``bos`` is the id the tokenizer puts before a sequence (Llama's ``<s>``, Llama 3's
    ``<|begin_of_text|>``), or None; callers put it before each document and prompt, so that
    ``[bos] + tokenize(text)`` equals the library's ``encode(text)`` with its special tokens;
  * ``eod`` is the end-of-sequence token, which ``--append-eod`` appends.
Without ``add_bos_token`` in a config, ``bos`` is the token the tokenizer.json's post-processor
puts first. Without a config, ``eod`` is the first of ``FALLBACK_EOS_TOKENS`` in the vocabulary.

A byte-level BPE file (GPT-2, Llama 3) is encoded by tiktoken where that gives the library's ids
(``hf_fast_path``; ``fast_path_reason`` says which), about 7x faster; otherwise, or with
``use_fast=False`` or MEGATRON_TOKENIZER_FAST=0, by the library.
"""
import json
import os

from megatron.core.tokenizer.bpe_files import TokenizerError
from megatron.core.tokenizer.gpt2_bpe import FAST_ENV_VAR, fast_path_requested
from megatron.core.tokenizer.hf_fast_path import build_tiktoken_path

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
# End-of-sequence tokens of the common tokenizer families, tried in order without a config.
FALLBACK_EOS_TOKENS = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>")
# Encoded with and without special tokens to see which token a tokenizer puts in front.
PROBE_TEXT = "a"


def leading_special_token(with_special, plain):
    """The BOS of a tokenizer: the one id its encoding ``with_special`` of a text puts before the
    text's ids ``plain``, or None where it puts none or several."""
    in_front = next((start for start in range(len(with_special) - len(plain) + 1)
                     if with_special[start:start + len(plain)] == plain), 0)
    return with_special[0] if in_front == 1 else None


def tokenizer_json_path(path, flag):
    """The tokenizer.json named by ``path`` (the file, or a directory holding it)."""
    candidate = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(candidate):
        where = f"has no {TOKENIZER_FILE}" if os.path.isdir(path) else "no such file"
        raise TokenizerError(f"{flag} {path}: {where} (HuggingFaceTokenizer reads a tokenizer.json, "
                             f"or a directory holding one)")
    return candidate


def _token_content(value):
    """A special token of tokenizer_config.json: a string, or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def read_tokenizer_config(tokenizer_file, flag):
    """The tokenizer_config.json beside ``tokenizer_file`` as a dict ({} when there is none)."""
    path = os.path.join(os.path.dirname(os.path.abspath(tokenizer_file)), CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError) as err:
        raise TokenizerError(f"{flag}: {path}: not a readable JSON file ({err})") from err
    if not isinstance(config, dict):
        raise TokenizerError(f"{flag}: {path}: expected a JSON object")
    return config


class HuggingFaceTokenizer:
    """A ``tokenizers.Tokenizer`` from a local tokenizer.json; see the module docstring.

    ``vocab_size`` = 1 + the largest id (added tokens included); ``detokenize`` is the library's
    ``decode`` keeping special tokens. Raises TokenizerError naming ``flag`` and the file when the
    file is missing or does not parse, or when the tokenizer has no end-of-sequence token.
    """

    def __init__(self, path, flag="--tokenizer-model", use_fast=None):
        self._arguments = (path, flag, use_fast)
        from tokenizers import Tokenizer
        self.tokenizer_file = tokenizer_json_path(path, flag)
        try:
            self._tokenizer = Tokenizer.from_file(self.tokenizer_file)
        except Exception as err:  # the library raises a bare Exception for any parse error
            raise TokenizerError(f"{flag} {self.tokenizer_file}: not a tokenizer.json the tokenizers "
                                 f"package can load ({err})") from None
        config = read_tokenizer_config(self.tokenizer_file, flag)
        self.vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.inv_vocab = {token_id: token for token, token_id in self.vocab.items()}
        self.vocab_size = max(self.vocab.values()) + 1
        self.eod = self._eos_id(config, flag)
        self.bos = self._bos_id(config, flag)
        self._fast_encode_batch, self.fast_path_reason = None, (
            f"HF tokenizers: tiktoken path switched off (use_fast=False or {FAST_ENV_VAR}=0)")
        if fast_path_requested(use_fast):
            self._fast_encode_batch, self.fast_path_reason = build_tiktoken_path(self.tokenizer_file,
                                                                                 self._tokenizer)
        self.is_fast = True

    def __reduce__(self):
        return HuggingFaceTokenizer, self._arguments

    def _special_id(self, token, key, flag):
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{flag} {self.tokenizer_file}: {CONFIG_FILE}'s {key} {token!r} is not "
                                 "in the tokenizer's vocabulary")
        return token_id

    def _eos_id(self, config, flag):
        eos = _token_content(config.get("eos_token"))
        if eos:
            return self._special_id(eos, "eos_token", flag)
        for token in FALLBACK_EOS_TOKENS:
            if self._tokenizer.token_to_id(token) is not None:
                return self._tokenizer.token_to_id(token)
        raise TokenizerError(f"{flag} {self.tokenizer_file}: the tokenizer has no end-of-sequence token "
                             f"(eod): put a {CONFIG_FILE} with eos_token beside it, or use a tokenizer "
                             f"with one of {', '.join(FALLBACK_EOS_TOKENS)}")

    def _bos_id(self, config, flag):
        if "add_bos_token" in config:
            bos = _token_content(config.get("bos_token"))
            if not config["add_bos_token"] or not bos:
                return None
            return self._special_id(bos, "bos_token", flag)
        return leading_special_token(self._tokenizer.encode(PROBE_TEXT, add_special_tokens=True).ids,
                                     self._tokenizer.encode(PROBE_TEXT, add_special_tokens=False).ids)

    def tokenize(self, text):
        """Token ids of ``text`` without special tokens: list[int]."""
        if self._fast_encode_batch is not None:
            return self._fast_encode_batch([text])[0]
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts):
        """``[tokenize(t) for t in texts]`` in one call (on the tiktoken path one thread, else the
        library, which may use several)."""
        if not texts:
            return []
        if self._fast_encode_batch is not None:
            return self._fast_encode_batch(list(texts))
        return [encoding.ids for encoding in self._tokenizer.encode_batch_fast(list(texts),
                                                                               add_special_tokens=False)]

    def detokenize(self, ids):
        """Text of ``ids`` (the library's decode, special tokens kept)."""
        return self._tokenizer.decode([int(token_id) for token_id in ids], skip_special_tokens=False)
