"""tiktoken fast path of a byte-level BPE tokenizer.json (GPT-2, Llama 3, Qwen2 layouts), used only
where it gives the ``tokenizers`` library's ids.

Eligible: no normalizer, or NFC (Qwen2's); a BPE model without dropout, byte fallback, subword
prefix or word suffix; a pre-tokenizer that is GPT-2's ByteLevel regex, or one Split regex
(isolated) followed by ByteLevel without its regex (Llama 3). The merges must pass
``fast_bpe.rank_table`` (so that tiktoken's merging equals pair-rank BPE), checked with the
library's own BPE model, and a probe text must encode identically. With ``ignore_merges`` (Llama
3's files) a vocabulary token that is neither a byte nor a merge result must not be a whole
pre-token piece, so that taking a piece found in the vocabulary is tiktoken's rule too.

At encoding time the library itself encodes a text holding an added token's content (the library
splits those out), a character whose regex class may differ between the libraries, or (with NFC)
a character sequence that NFC would change.
"""
import json
import re
import unicodedata

from megatron.core.tokenizer.fast_bpe import (_PROBE_TEXT, TIKTOKEN_SPLIT_PATTERN, RankTableError, TiktokenBPE,
                                              byte_token_bytes, has_unstable_characters, rank_table)


class NotEligible(Exception):
    """The tokenizer.json is not one the tiktoken path reproduces; the message says why."""


def _split_pattern(pre_tokenizer):
    """The tiktoken pattern equal to this pre-tokenizer, or NotEligible."""
    def byte_level(node, use_regex):
        return (node.get("type") == "ByteLevel" and not node.get("add_prefix_space")
                and bool(node.get("use_regex", True)) == use_regex)

    if pre_tokenizer and byte_level(pre_tokenizer, True):
        return TIKTOKEN_SPLIT_PATTERN
    parts = (pre_tokenizer or {}).get("pretokenizers") or []
    if (pre_tokenizer or {}).get("type") == "Sequence" and len(parts) == 2 and byte_level(parts[1], False):
        split = parts[0]
        if (split.get("type") == "Split" and split.get("behavior") == "Isolated" and not split.get("invert")
                and "Regex" in split.get("pattern", {})):
            return split["pattern"]["Regex"]
    raise NotEligible("the pre-tokenizer is not byte-level BPE's (ByteLevel, or Split + ByteLevel)")


def _nfc_normalized(normalizer):
    """Whether the normalizer is none (False) or NFC (True); NotEligible for any other."""
    if not normalizer:
        return False
    if normalizer.get("type") == "Sequence" and len(normalizer.get("normalizers", [])) == 1:
        normalizer = normalizer["normalizers"][0]
    if normalizer.get("type") != "NFC":
        raise NotEligible(f"the tokenizer has a {normalizer.get('type')} normalizer")
    return True


def _bpe_model(spec):
    """(vocab, merges as pairs, ignore_merges) of an eligible BPE model, or NotEligible."""
    model = spec.get("model") or {}
    unsupported = [key for key in ("dropout", "byte_fallback", "continuing_subword_prefix", "end_of_word_suffix")
                   if model.get(key)]
    if model.get("type") != "BPE" or unsupported:
        raise NotEligible(f"the model is not a plain BPE ({model.get('type')}, {', '.join(unsupported)})")
    merges = [tuple(merge.split(" ", 1)) if isinstance(merge, str) else tuple(merge) for merge in model["merges"]]
    return model["vocab"], merges, bool(model.get("ignore_merges"))


def build_tiktoken_path(tokenizer_file, library):
    """``(encode_batch function, reason)`` for the tokenizer.json ``tokenizer_file`` whose loaded
    ``tokenizers.Tokenizer`` is ``library``; the function is None where the fast path is not exact."""
    from tokenizers import models

    try:
        import tiktoken  # noqa: F401  (an optional speed-up: without it the library encodes)
        with open(tokenizer_file, encoding="utf-8") as handle:
            spec = json.load(handle)
        pattern = _split_pattern(spec.get("pre_tokenizer"))
        nfc = _nfc_normalized(spec.get("normalizer"))
        vocab, merges, ignore_merges = _bpe_model(spec)
        pair_rank_bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=False)
        ranks, rank_to_id = rank_table(vocab, merges,
                                       lambda word: [token.value for token in pair_rank_bpe.tokenize("".join(word))])
        if ignore_merges:
            _check_no_whole_piece_shortcut(vocab, ranks, library)
        encoder = _GuardedTiktoken(TiktokenBPE(ranks, rank_to_id, pattern), library,
                                   [token["content"] for token in spec.get("added_tokens", [])], nfc)
    except (ImportError, NotEligible, RankTableError) as err:
        return None, f"HF tokenizers (no tiktoken path: {err})"
    merge_texts = [byte_token_bytes(left + right) for left, right in merges[:2000]]
    probe = _PROBE_TEXT + " ".join(data.decode("utf-8", errors="replace") for data in merge_texts if data)
    if encoder.encode_batch([probe]) != [library.encode(probe, add_special_tokens=False).ids]:
        return None, "HF tokenizers (the tiktoken path encodes a probe text differently)"
    return encoder.encode_batch, "tiktoken (checked equal to HF tokenizers)"


def _check_no_whole_piece_shortcut(vocab, ranks, library):
    """NotEligible where ``ignore_merges`` could give a vocabulary token tiktoken never gives: one
    that is neither a byte nor a merge result, yet a whole pre-token piece of its own text."""
    for token in vocab:
        data = byte_token_bytes(token)
        if data is None or data in ranks:
            continue
        pieces = library.pre_tokenizer.pre_tokenize_str(data.decode("utf-8", errors="replace"))
        if [piece for piece, _ in pieces] == [token]:
            raise NotEligible(f"ignore_merges, and the vocabulary token {token!r} is neither a byte nor a "
                              "merge result but a whole pre-token piece")


class _GuardedTiktoken:
    """tiktoken on plain texts; the library on texts with added tokens or unstable characters, and
    (``nfc``) on texts that NFC normalization would change."""

    def __init__(self, tiktoken_bpe, library, added_tokens, nfc):
        self._tiktoken_bpe = tiktoken_bpe
        self._library = library
        self._nfc = nfc
        contents = sorted((token for token in added_tokens if token), key=len, reverse=True)
        self._added = re.compile("|".join(map(re.escape, contents))) if contents else None

    def _needs_library(self, text):
        return (has_unstable_characters(text) or (self._nfc and not unicodedata.is_normalized("NFC", text))
                or (self._added is not None and self._added.search(text) is not None))

    def encode_batch(self, texts):
        return [self._library.encode(text, add_special_tokens=False).ids if self._needs_library(text)
                else self._tiktoken_bpe.encode(text) for text in texts]
