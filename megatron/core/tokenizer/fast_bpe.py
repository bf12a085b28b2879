"""Compiled fast paths for GPT-2 byte-level BPE, used only where they give the reference's ids.

tiktoken merges, among adjacent parts x, y, the pair whose concatenation xy has the lowest rank,
and takes a pre-token piece that is itself a token as that token; the reference merges the pair
(x, y) of lowest merge rank, from single bytes. ``rank_table`` accepts files on which the two agree:
  * ranks are the merge order: the 256 bytes, then rank(result of merge i) = 256 + i;
  * every merge joins bytes or results of earlier merges, and no two merges give one result;
  * every merge result is what the reference makes of its own bytes (so the piece shortcut is
    exact, and a pair that is not a merge never wins by its result's rank).
Files from BPE training (GPT-2's, ``tools/train_tokenizer.py``'s) pass. Randomly built merge lists
that pass were also checked to encode like the reference; ones that fail the last condition do
not. Ids come from ``vocab.json`` through a rank -> id table, the identity for GPT-2's layout.

Files that fail the checks use HF ``tokenizers`` (pair-rank BPE like the reference) if it encodes
a probe text like the reference, and otherwise no fast path (the caller keeps the reference).

Pre-tokenization classes (\\p{L}, \\p{N}, \\s) come from each library's own Unicode tables, which
differ for characters assigned by recent Unicode versions. A text holding a character unassigned in
this Python's Unicode database (category Cn), or a lone surrogate (Cs), is therefore encoded by the
reference; every other character was checked to split identically (tests/core/tokenizer).
"""
import unicodedata

import numpy as np

from megatron.core.tokenizer.bpe_files import EOD_TOKEN, TokenizerError, byte_token_bytes, bytes_to_unicode

# Probe for the HF fallback: contractions, runs of spaces and newlines, digits, non-ASCII, emoji.
_PROBE_TEXT = (
    "It's we're they've I'm you'll he'd don't  --  double  spaces\n\n\tand tabs   \n"
    "Numbers 1234567 3.14 x=y+2; naïve café Ünïcödé 日本語のテキスト Привет мир 🙂👍🏽 "
    "<|endoftext|> end.  "
)


# GPT2_SPLIT_PATTERN rewritten for tiktoken's engine, with the same matches: the contractions
# factored (no alternative is a prefix of another) and the lookahead-free alternatives grouped, so
# the engine hands them to its fast automaton as one piece (about 1.35x faster here).
TIKTOKEN_SPLIT_PATTERN = (
    r"""(?:'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+)|\s+(?!\S)|\s+"""
)


class RankTableError(TokenizerError):
    """The files break a condition under which tiktoken's merging equals the reference."""


def rank_table(vocab, merges, merge_pieces):
    """tiktoken ranks and the rank -> id table for ``vocab``/``merges``, or RankTableError.

    ``merge_pieces`` is the reference's BPE of one piece (list of byte characters -> tokens).

    Returns ``(mergeable_ranks, rank_to_id)``: ``mergeable_ranks`` maps token bytes to rank (bytes
    0..255, merge i -> 256 + i); ``rank_to_id[r]`` is the vocab id of the token of rank r.
    Vocabulary tokens that are neither bytes, merge results nor <|endoftext|> are never produced by
    the reference, so they are left out of the ranks.
    """
    byte_chars = list(bytes_to_unicode().values())
    missing = [char for char in byte_chars if char not in vocab]
    if missing:
        raise RankTableError(f"{len(missing)} of the 256 byte tokens are missing from the vocab "
                             f"(e.g. {missing[0]!r})")
    if all(vocab[char] < 256 for char in byte_chars):
        byte_chars.sort(key=vocab.__getitem__)
    rank_of_token = {char: rank for rank, char in enumerate(byte_chars)}
    for index, (left, right) in enumerate(merges):
        for part in (left, right):
            if part not in rank_of_token:
                raise RankTableError(f"merge {index} ({left} {right}) uses {part!r}, which is "
                                     "not a byte or the result of an earlier merge")
        result = left + right
        if result in rank_of_token:
            raise RankTableError(f"merge {index} ({left} {right}) gives {result!r}, the result of "
                                 f"merge {rank_of_token[result] - 256}: duplicate merge results")
        rank_of_token[result] = 256 + index
    for index, (left, right) in enumerate(merges):
        if len(left) + len(right) > 2 and merge_pieces(list(left + right)) != [left + right]:
            raise RankTableError(f"merge {index} ({left} {right}): the reference encodes "
                                 f"{left + right!r} as {merge_pieces(list(left + right))}, not as "
                                 "that token")
    # rank_of_token is in rank order (ranks 0, 1, 2, ... were inserted in turn).
    mergeable_ranks = {byte_token_bytes(token): rank for token, rank in rank_of_token.items()}
    rank_to_id = np.array([vocab[token] for token in rank_of_token], dtype=np.int64)
    return mergeable_ranks, rank_to_id


# Accepted rank tables (or the RankTableError) by digest of the files' bytes, so that rebuilding a
# tokenizer in the same or a forked process skips the checks. A few entries: one per tokenizer.
_RANK_TABLE_CACHE_SIZE = 4
_rank_table_cache = {}


def cached_rank_table(files_digest, vocab, merges, merge_pieces):
    """``rank_table`` memoised by ``files_digest`` (None: not memoised)."""
    result = _rank_table_cache.get(files_digest) if files_digest else None
    if result is None:
        try:
            result = rank_table(vocab, merges, merge_pieces)
        except RankTableError as err:
            result = err
        if files_digest:
            while len(_rank_table_cache) >= _RANK_TABLE_CACHE_SIZE:
                _rank_table_cache.pop(next(iter(_rank_table_cache)))
            _rank_table_cache[files_digest] = result
    if isinstance(result, RankTableError):
        raise result
    return result


_UNSTABLE_CATEGORIES = ("Cn", "Cs")
_stable_characters = set(map(chr, range(128)))


def has_unstable_characters(text):
    """Whether ``text`` holds a character whose regex class may differ between libraries."""
    if text.isascii():
        return False
    unseen = set(text).difference(_stable_characters)
    for char in unseen:
        if unicodedata.category(char) in _UNSTABLE_CATEGORIES:
            return True
        _stable_characters.add(char)
    return False


class GuardedEncoder:
    """A compiled encoder that hands texts with unstable characters to the reference encoder."""

    def __init__(self, compiled_encode, reference_encode):
        self._compiled_encode = compiled_encode
        self._reference_encode = reference_encode

    def encode(self, text):
        if has_unstable_characters(text):
            return self._reference_encode(text)
        return self._compiled_encode(text)

    def encode_batch(self, texts):
        return [self.encode(text) for text in texts]


class TiktokenBPE:
    """Encoder on a tiktoken ``Encoding`` built offline from the ranks (``encode_ordinary``) and
    the pre-tokenization ``pattern`` (GPT-2's by default).

    ``encode_ordinary`` ignores special tokens, so a literal <|endoftext|> is ordinary text, like
    the reference. It runs on the calling thread: parallelism comes from worker processes.
    """

    def __init__(self, mergeable_ranks, rank_to_id, pattern=TIKTOKEN_SPLIT_PATTERN):
        import tiktoken

        self._encoding = tiktoken.Encoding(
            name="megatron_gpt2_bpe", pat_str=pattern,
            mergeable_ranks=mergeable_ranks, special_tokens={EOD_TOKEN: len(mergeable_ranks)})
        self.ids_are_ranks = np.array_equal(rank_to_id, np.arange(len(rank_to_id)))
        self._rank_to_id = rank_to_id.tolist()

    def encode(self, text):
        ranks = self._encoding.encode_ordinary(text)
        if self.ids_are_ranks:
            return ranks
        rank_to_id = self._rank_to_id
        return [rank_to_id[rank] for rank in ranks]


class HFTokenizersBPE:
    """Encoder on an HF ``tokenizers`` BPE model with GPT-2's byte-level pre-tokenizer."""

    def __init__(self, vocab, merges):
        from tokenizers import Tokenizer, models, pre_tokenizers

        self._tokenizer = Tokenizer(models.BPE(vocab=dict(vocab), merges=list(merges)))
        self._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                 use_regex=True)

    def encode(self, text):
        return self._tokenizer.encode(text, add_special_tokens=False).ids


def build_fast_backend(vocab, merges, reference, files_digest=None):
    """Choose a compiled encoder for these files: ``(encoder or None, reason)``.

    tiktoken when ``rank_table`` accepts the files, else HF ``tokenizers`` when it encodes a probe
    text like ``reference`` (a ReferenceBPE), else None (the caller keeps the reference).
    ``files_digest`` (a digest of the files' bytes) memoises the checks within a process.
    """
    reference_encode = reference.encode
    try:
        tiktoken_bpe = TiktokenBPE(*cached_rank_table(files_digest, vocab, merges,
                                                      reference.merge_pieces))
    except (RankTableError, ImportError) as err:
        tiktoken_problem = str(err)
    else:
        mapping = "ids = ranks" if tiktoken_bpe.ids_are_ranks else "rank -> id table"
        return GuardedEncoder(tiktoken_bpe.encode, reference_encode), f"tiktoken ({mapping})"
    hf_bpe, hf_problem = _checked_hf_tokenizers(vocab, merges, reference_encode)
    if hf_bpe is None:
        return None, f"regex reference: tiktoken unusable ({tiktoken_problem}); {hf_problem}"
    return (GuardedEncoder(hf_bpe.encode, reference_encode),
            f"HF tokenizers (tiktoken unusable: {tiktoken_problem})")


def _checked_hf_tokenizers(vocab, merges, reference_encode):
    """``(HFTokenizersBPE, None)`` if it encodes the probe text (with the text of the first 2000
    merge results) like the reference, else ``(None, why)``."""
    try:
        hf_bpe = HFTokenizersBPE(vocab, merges)
    except Exception as err:  # noqa: BLE001 - any failure of this optional path: no fast path
        return None, f"HF tokenizers failed to load the files ({err})"
    merge_bytes = [byte_token_bytes(left + right) for left, right in merges[:2000]]
    probe = _PROBE_TEXT + " ".join(data.decode("utf-8", errors="replace")
                                   for data in merge_bytes if data)
    if hf_bpe.encode(probe) != reference_encode(probe):
        return None, "HF tokenizers encodes a probe text differently"
    return hf_bpe, None
