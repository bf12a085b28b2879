"""GPT-2 byte-level BPE: the regex reference encoder and the public tokenizer.

Byte-level BPE works on the UTF-8 bytes of the text. Every byte b is first written as one printable
character ``bytes_to_unicode()[b]`` (the alphabet and file formats live in ``bpe_files``); the
text is split into pieces by the GPT-2 pre-tokenization pattern, and inside each piece the adjacent
pair with the lowest merge rank is merged, all of its occurrences left to right, until no adjacent
pair is a merge. Decoding concatenates the tokens' bytes, so it returns the original text.

``<|endoftext|>`` is the end-of-document id (``eod``) but is never produced by ``tokenize``: a
literal "<|endoftext|>" inside a document is encoded as ordinary text (``<``, ``|``, ``endoftext``,
``|>``), as Megatron's GPT-2 tokenizer does, so a document cannot inject a document boundary.
Preprocessing appends ``eod`` explicitly.
"""
import functools
import hashlib
import itertools
import os

import regex

from megatron.core.tokenizer.bpe_files import (EOD_TOKEN, TokenizerError, bytes_to_unicode,
                                               check_merges_in_vocab, read_merge_file, read_vocab_file,
                                               token_bytes_by_id)

# GPT-2's pre-tokenization: contractions, optional space + letters / digits / other symbols,
# whitespace not followed by non-space (so a run of spaces leaves its last space to the next word).
GPT2_SPLIT_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)

# Distinct pieces whose token ids the reference keeps; Megatron-DeepSpeed's unbounded dict grew with the
# corpus' vocabulary of words and exhausted memory on large inputs.
DEFAULT_BPE_CACHE_SIZE = 1 << 17

# Rank of a pair that is not a merge: above every real rank.
_NOT_A_MERGE = 1 << 62

# MEGATRON_TOKENIZER_FAST=0 forces the regex reference wherever ``use_fast`` is left at None.
FAST_ENV_VAR = "MEGATRON_TOKENIZER_FAST"


class ReferenceBPE:
    """The regex reference encoder: GPT-2's algorithm, in Python, with a bounded piece cache.

    Each pre-token piece, written in byte characters, starts as single characters; the adjacent
    pair of lowest merge rank is merged at every left-to-right occurrence, until no adjacent pair
    is a merge. Piece -> ids results are kept in an LRU cache of ``cache_size`` pieces.
    """

    def __init__(self, vocab, merges, cache_size=DEFAULT_BPE_CACHE_SIZE):
        self.vocab = vocab
        self.merge_ranks = {pair: rank for rank, pair in enumerate(merges)}
        # str.translate table: Latin-1 code point of a byte -> its byte character.
        self._latin1_to_byte_char = dict(bytes_to_unicode())
        self._pattern = regex.compile(GPT2_SPLIT_PATTERN)
        self._piece_ids = functools.lru_cache(maxsize=cache_size)(self._encode_piece)

    def merge_pieces(self, word):
        """BPE of one piece: ``word`` is its list of byte characters; returns the token strings.

        ``pair_ranks[j]`` is the merge rank of (word[j], word[j + 1]); a merge changes only the
        ranks next to it. Ranks identify pairs, so the occurrences of the best pair are the
        positions holding the lowest rank.
        """
        ranks = self.merge_ranks
        pair_ranks = list(map(ranks.get, zip(word, word[1:]), itertools.repeat(_NOT_A_MERGE)))
        while pair_ranks:
            best_rank = min(pair_ranks)
            if best_rank == _NOT_A_MERGE:
                break
            if pair_ranks.count(best_rank) > 1:
                word = _merge_occurrences(word, pair_ranks, best_rank)
                pair_ranks = list(map(ranks.get, zip(word, word[1:]),
                                      itertools.repeat(_NOT_A_MERGE)))
                continue
            first = pair_ranks.index(best_rank)
            merged = word[first] + word[first + 1]
            word[first:first + 2] = [merged]
            del pair_ranks[first]
            if first > 0:
                pair_ranks[first - 1] = ranks.get((word[first - 1], merged), _NOT_A_MERGE)
            if first < len(pair_ranks):
                pair_ranks[first] = ranks.get((merged, word[first + 1]), _NOT_A_MERGE)
        return word

    def _encode_piece(self, piece_chars):
        try:
            return tuple(self.vocab[token] for token in self.merge_pieces(list(piece_chars)))
        except KeyError as err:
            raise TokenizerError(f"token {err.args[0]!r} is not in the vocabulary; a byte-level "
                                 "vocabulary must hold every byte the text uses") from None

    def encode(self, text):
        """Token ids of ``text`` (a literal <|endoftext|> is ordinary text)."""
        ids = []
        for piece in self._pattern.findall(text):
            try:
                utf8 = piece.encode("utf-8")
            except UnicodeEncodeError as err:
                raise TokenizerError(f"cannot tokenize: the text holds a lone surrogate "
                                     f"{piece[err.start]!r}, which is not valid Unicode") from None
            ids.extend(self._piece_ids(utf8.decode("latin-1").translate(self._latin1_to_byte_char)))
        return ids


def _merge_occurrences(word, pair_ranks, rank):
    """``word`` with the pair of ``rank`` merged at each occurrence, left to right."""
    merged, start = [], 0
    for index, pair_rank in enumerate(pair_ranks):
        if pair_rank == rank and index >= start:
            merged.extend(word[start:index])
            merged.append(word[index] + word[index + 1])
            start = index + 2
    merged.extend(word[start:])
    return merged


def _files_digest(*paths):
    """SHA-256 of the files' bytes, in order."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            digest.update(handle.read())
        digest.update(b"\0")
    return digest.hexdigest()


def fast_path_requested(use_fast):
    """Resolve ``use_fast``: None follows MEGATRON_TOKENIZER_FAST (default on), else the bool."""
    if use_fast is not None:
        return bool(use_fast)
    return os.environ.get(FAST_ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


class GPT2BPETokenizer:
    """GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt``, with ``<|endoftext|>`` as eod.

    Encoding runs on a compiled backend (tiktoken, else HF ``tokenizers``) when one reproduces the
    reference's ids for these files (see ``fast_bpe``); otherwise, or with ``use_fast=False`` or
    MEGATRON_TOKENIZER_FAST=0, on the regex reference. ``fast_path_reason`` says which and why.
    ``use_fast=True`` raises TokenizerError when no compiled backend is valid.
    """

    def __init__(self, vocab_file, merge_file, use_fast=None):
        self._arguments = (vocab_file, merge_file, use_fast)
        self.vocab = read_vocab_file(vocab_file)
        merges = read_merge_file(merge_file)
        check_merges_in_vocab(self.vocab, merges, merge_file)
        if EOD_TOKEN not in self.vocab:
            raise TokenizerError(f"--vocab-file {vocab_file}: has no {EOD_TOKEN} token (the eod)")
        self.eod = self.vocab[EOD_TOKEN]
        self.bos = None  # GPT-2 starts no sequence with a special token
        self.vocab_size = len(self.vocab)
        self.inv_vocab = {token_id: token for token, token_id in self.vocab.items()}
        self._id_to_bytes = token_bytes_by_id(self.vocab)
        self._reference = ReferenceBPE(self.vocab, merges)
        self._backend = None
        if fast_path_requested(use_fast):
            # Imported on demand: fast_bpe needs numpy, which importing the tokenizer package does not.
            from megatron.core.tokenizer.fast_bpe import build_fast_backend
            self._backend, self.fast_path_reason = build_fast_backend(
                self.vocab, merges, self._reference, _files_digest(vocab_file, merge_file))
            if self._backend is None and use_fast:
                raise TokenizerError(f"use_fast=True but no fast path: {self.fast_path_reason}")
        else:
            self.fast_path_reason = ("regex reference: fast path switched off "
                                     f"(use_fast=False or {FAST_ENV_VAR}=0)")
        self.is_fast = self._backend is not None

    def __reduce__(self):
        # Rebuilt from the files in the receiving process: caches and compiled state do not pickle.
        return GPT2BPETokenizer, self._arguments

    def tokenize(self, text):
        """Token ids of ``text``: list[int]; never contains ``eod``."""
        if self._backend is not None:
            return self._backend.encode(text)
        return self._reference.encode(text)

    def tokenize_batch(self, texts):
        """``[tokenize(t) for t in texts]``, on one thread, with less per-call overhead."""
        if self._backend is not None:
            return self._backend.encode_batch(texts)
        return [self._reference.encode(text) for text in texts]

    def detokenize(self, ids):
        """Text of ``ids``: their bytes decoded as UTF-8 (invalid sequences become U+FFFD)."""
        try:
            if len(ids) and min(ids) < 0:
                raise IndexError(f"negative id {min(ids)}")
            data = b"".join([self._id_to_bytes[token_id] for token_id in ids])
        except (IndexError, TypeError) as err:
            raise TokenizerError(f"cannot detokenize: an id is not in the vocabulary "
                                 f"(0..{len(self._id_to_bytes) - 1}): {err}") from None
        return data.decode("utf-8", errors="replace")
