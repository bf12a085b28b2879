"""GPT2BPETokenizer: hand-computed ids on a tiny vocabulary, fast path == reference, round trips."""
import gzip
import json
import pickle
import unicodedata

import pytest

from megatron.core.tokenizer import GPT2BPETokenizer, TokenizerError, build_tokenizer
from megatron.core.tokenizer.gpt2_bpe import (EOD_TOKEN, ReferenceBPE, bytes_to_unicode,
                                              read_merge_file)

# Ids of single bytes in GPT-2's layout, written out by hand from GPT-2's byte order:
# '!'..'~' are 0..93 (id = byte - 33), bytes 0..32 are 188..220 ('\n' 198, ' ' 220),
# bytes 127..160 are 221..254, latin-1 '¡'..'¬' are 94..105 and '®'..'ÿ' are 106..187.
TINY_MERGES = [
    ("Ġ", "t"),    # 256 " t"
    ("h", "e"),    # 257 "he"
    ("Ġt", "he"),  # 258 " the"
    ("'", "s"),    # 259 "'s"
    ("'", "t"),    # 260 "'t"
    ("'", "r"),    # 261 "'r"
    ("'r", "e"),   # 262 "'re"
    ("'", "l"),    # 263 "'l"
    ("'l", "l"),   # 264 "'ll"
    ("Ġ", "Ġ"),    # 265 two spaces
    ("Ċ", "Ċ"),    # 266 two newlines
    ("ð", "Ł"),    # 267 bytes F0 9F, the start of most emoji
    ("Ã", "©"),    # 268 bytes C3 A9, "é"
    ("<", "|"),    # 269 "<|"
    ("|", ">"),    # 270 "|>"
]
TINY_EOD = 271

# text -> ids, worked out by hand: GPT-2 pre-tokenization, then the merges above in rank order.
TINY_CASES = {
    "the": [83, 257],                       # "the": t, he
    " the": [258],                          # Ġt (0), he (1), Ġthe (2)
    "it's": [72, 83, 259],                  # "it" "'s"
    "don't": [67, 78, 77, 260],             # "don" "'t"
    "we're": [86, 68, 262],                 # "we" "'re": 'r then 're
    "I've": [40, 6, 85, 68],                # "I" "'ve" (no merge for 've)
    "I'm": [40, 6, 76],                     # "I" "'m"
    "you'll": [88, 78, 84, 264],            # "you" "'ll": 'l then 'll
    "he'd": [257, 6, 67],                   # "he" "'d"
    "IT'S": [40, 51, 6, 50],                # contractions are lower case only: "IT" "'" "S"
    "a   b": [64, 265, 220, 65],            # "a" "  " " b": a run gives its last space to the word
    "a  ": [64, 265],                       # a trailing run stays whole
    "    x": [265, 220, 220, 87],           # "   " -> ĠĠ Ġ (leftmost first), then " x"
    "a\n\nb": [64, 198, 198, 65],           # "\n" "\n": the last newline is its own piece
    "a\n\n": [64, 266],                     # trailing "\n\n" -> one merge
    "\n\n\nb": [266, 198, 65],
    "café": [66, 64, 69, 268],              # é = C3 A9 merged
    " é": [220, 268],                       # " é" is one piece; Ġ does not merge with Ã
    "😀": [267, 246, 222],                  # F0 9F 98 80: ðŁ, then 98, 80
    " 😀": [220, 267, 246, 222],
    "<|endoftext|>": [269, 68, 77, 67, 78, 69, 83, 68, 87, 83, 270],  # ordinary text, not eod
    "a<|endoftext|>b": [64, 269, 68, 77, 67, 78, 69, 83, 68, 87, 83, 270, 65],
}


def write_tokenizer(directory, vocab, merges, version_line=True):
    vocab_file, merge_file = directory / "vocab.json", directory / "merges.txt"
    vocab_file.write_text(json.dumps(vocab), encoding="utf-8")
    lines = (["#version: 0.2"] if version_line else []) + [f"{a} {b}" for a, b in merges]
    merge_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(vocab_file), str(merge_file)


def tiny_vocab():
    vocab = {char: index for index, char in enumerate(bytes_to_unicode().values())}
    for left, right in TINY_MERGES:
        vocab[left + right] = len(vocab)
    vocab[EOD_TOKEN] = len(vocab)
    return vocab


@pytest.fixture
def tiny_files(tmp_path):
    return write_tokenizer(tmp_path, tiny_vocab(), TINY_MERGES)


def corpus_texts(sample_corpus):
    with gzip.open(sample_corpus, "rt", encoding="utf-8") as handle:
        return [json.loads(line)["text"] for line in handle]


def test_byte_ids_follow_gpt2_order():
    vocab = tiny_vocab()
    assert [vocab[bytes_to_unicode()[byte]] for byte in (33, 126, 0, 10, 32, 127, 160, 161, 173,
                                                         174, 255)] == \
        [0, 93, 188, 198, 220, 221, 254, 94, 255, 106, 187]


@pytest.mark.parametrize("use_fast", [False, True])
def test_tiny_vocabulary_hand_computed_ids(tiny_files, use_fast):
    tokenizer = build_tokenizer("GPT2BPETokenizer", *tiny_files, use_fast=use_fast)
    assert tokenizer.is_fast == use_fast
    assert tokenizer.eod == TINY_EOD and tokenizer.vocab_size == TINY_EOD + 1
    for text, expected in TINY_CASES.items():
        assert tokenizer.tokenize(text) == expected, text
        assert tokenizer.detokenize(expected) == text
    texts = list(TINY_CASES)
    assert tokenizer.tokenize_batch(texts) == list(TINY_CASES.values())


def test_literal_eod_never_encodes_as_eod(tiny_files):
    for use_fast in (False, True):
        tokenizer = GPT2BPETokenizer(*tiny_files, use_fast=use_fast)
        ids = tokenizer.tokenize(f"doc one{EOD_TOKEN}doc two {EOD_TOKEN}\n{EOD_TOKEN}")
        assert TINY_EOD not in ids
        assert tokenizer.detokenize([TINY_EOD]) == EOD_TOKEN


def test_merge_file_without_version_line(tmp_path):
    files = write_tokenizer(tmp_path, tiny_vocab(), TINY_MERGES, version_line=False)
    tokenizer = GPT2BPETokenizer(*files, use_fast=False)
    assert tokenizer.tokenize(" the") == [258]


def test_fast_path_switched_off_by_environment(tiny_files, monkeypatch):
    monkeypatch.setenv("MEGATRON_TOKENIZER_FAST", "0")
    tokenizer = build_tokenizer("GPT2BPETokenizer", *tiny_files)
    assert not tokenizer.is_fast and "MEGATRON_TOKENIZER_FAST" in tokenizer.fast_path_reason
    monkeypatch.setenv("MEGATRON_TOKENIZER_FAST", "1")
    assert build_tokenizer("GPT2BPETokenizer", *tiny_files).is_fast


def test_reference_and_fast_path_agree_on_the_corpus(gpt2_tokenizer_files, sample_corpus):
    texts = corpus_texts(sample_corpus)
    fast = build_tokenizer("GPT2BPETokenizer", *gpt2_tokenizer_files)
    reference = build_tokenizer("GPT2BPETokenizer", *gpt2_tokenizer_files, use_fast=False)
    assert fast.is_fast and fast.fast_path_reason == "tiktoken (ids = ranks)"
    assert not reference.is_fast
    fast_ids = fast.tokenize_batch(texts)
    assert fast_ids == [reference.tokenize(text) for text in texts]
    assert fast_ids == [fast.tokenize(text) for text in texts]
    assert sum(map(len, fast_ids)) > 500_000


def test_reference_and_fast_path_agree_with_the_large_vocabulary(gpt2_tokenizer_files_50k,
                                                                sample_corpus):
    texts = corpus_texts(sample_corpus)
    fast = build_tokenizer("GPT2BPETokenizer", *gpt2_tokenizer_files_50k)
    reference = build_tokenizer("GPT2BPETokenizer", *gpt2_tokenizer_files_50k, use_fast=False)
    assert fast.is_fast and fast.vocab_size > 30_000
    assert fast.tokenize_batch(texts) == reference.tokenize_batch(texts)


def test_detokenize_round_trips_the_corpus(gpt2_tokenizer_files, sample_corpus):
    tokenizer = build_tokenizer("GPT2BPETokenizer", *gpt2_tokenizer_files)
    texts = corpus_texts(sample_corpus)
    for text, ids in zip(texts, tokenizer.tokenize_batch(texts)):
        assert tokenizer.detokenize(ids) == text
    odd = ["", " ", "\n\n\n", "  \t \r\n x", "ﬁ ß ǅ İ ‮rtl‬ \u200b\ufeff", "👩‍👩‍👧‍👦🏳️‍🌈",
           "日本語のテキスト", "\x00\x01\x7f", "a" * 5000, EOD_TOKEN * 3]
    for text in odd:
        for use_fast in (False, True):
            tok = build_tokenizer("GPT2BPETokenizer", *gpt2_tokenizer_files, use_fast=use_fast)
            assert tok.detokenize(tok.tokenize(text)) == text


def test_every_assigned_code_point_splits_like_the_reference(gpt2_tokenizer_files):
    """All assigned characters (the fast path's domain), between letters, digits, spaces, quotes.

    Unassigned ones (Cn) go to the reference by design; private-use ones (Co) are one class.
    """
    fast = build_tokenizer("GPT2BPETokenizer", *gpt2_tokenizer_files)
    reference = build_tokenizer("GPT2BPETokenizer", *gpt2_tokenizer_files, use_fast=False)
    separators = ["", " ", "  ", "a", "1", "\n", "'s", " a"]
    code_points = [c for c in range(0x110000)
                   if unicodedata.category(chr(c)) not in ("Cn", "Cs", "Co")]
    assert len(code_points) > 140_000
    texts = ["x \U000e01f0 y", "\U000e01f0\U000e01f0 z"]  # unassigned: handed to the reference
    for start in range(0, len(code_points), 64):
        chunk = code_points[start:start + 64]
        texts.append("".join(chr(c) + separators[(c + start) % len(separators)] for c in chunk))
    assert fast.tokenize_batch(texts) == reference.tokenize_batch(texts)


def test_lone_surrogate_is_a_clear_error(gpt2_tokenizer_files):
    for use_fast in (False, True):
        tokenizer = build_tokenizer("GPT2BPETokenizer", *gpt2_tokenizer_files, use_fast=use_fast)
        with pytest.raises(TokenizerError, match="surrogate"):
            tokenizer.tokenize("bad \ud800 text")


def test_reference_cache_is_bounded(gpt2_tokenizer_files):
    vocab = json.load(open(gpt2_tokenizer_files[0], encoding="utf-8"))
    merges = read_merge_file(gpt2_tokenizer_files[1])
    reference = ReferenceBPE(vocab, merges, cache_size=100)
    unbounded = ReferenceBPE(vocab, merges, cache_size=None)
    text = " ".join(f"word{index}x" for index in range(2000))
    assert reference.encode(text) == unbounded.encode(text)
    info = reference._piece_ids.cache_info()
    assert info.maxsize == 100 and info.currsize == 100
    assert GPT2BPETokenizer(*gpt2_tokenizer_files, use_fast=False) \
        ._reference._piece_ids.cache_info().maxsize is not None


def test_pickles_for_worker_processes(tiny_files):
    for use_fast in (False, None):
        tokenizer = build_tokenizer("GPT2BPETokenizer", *tiny_files, use_fast=use_fast)
        tokenizer.tokenize("warm the cache")
        copy = pickle.loads(pickle.dumps(tokenizer))
        assert copy.is_fast == tokenizer.is_fast and copy.eod == TINY_EOD
        assert copy.tokenize_batch(list(TINY_CASES)) == list(TINY_CASES.values())


def test_detokenize_rejects_unknown_ids(tiny_files):
    tokenizer = GPT2BPETokenizer(*tiny_files)
    for ids in ([TINY_EOD + 1], [-1]):
        with pytest.raises(TokenizerError, match="not in the vocabulary"):
            tokenizer.detokenize(ids)


@pytest.mark.parametrize("tokenizer_type", ["BertWordPieceLowerCase", "BertWordPieceCase"])
def test_bert_types_are_rejected(tokenizer_type, tiny_files):
    with pytest.raises(TokenizerError, match=f"--tokenizer-type {tokenizer_type} is not supported"):
        build_tokenizer(tokenizer_type, *tiny_files)


def test_bad_arguments_and_files(tmp_path, tiny_files):
    with pytest.raises(TokenizerError, match="unknown"):
        build_tokenizer("SentencePiece", *tiny_files)
    with pytest.raises(TokenizerError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=tiny_files[0])
    with pytest.raises(TokenizerError, match="--vocab-file .*missing.json: no such file"):
        build_tokenizer("GPT2BPETokenizer", str(tmp_path / "missing.json"), tiny_files[1])
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match="not a JSON file"):
        build_tokenizer("GPT2BPETokenizer", str(bad_json), tiny_files[1])
    bad_merges = tmp_path / "bad_merges.txt"
    bad_merges.write_text("#version: 0.2\nĠ t\nh e x\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match="bad_merges.txt:3: expected two tokens"):
        build_tokenizer("GPT2BPETokenizer", tiny_files[0], str(bad_merges))
    unknown_part = tmp_path / "unknown.txt"
    unknown_part.write_text("#version: 0.2\nĠ t\nq z\n", encoding="utf-8")
    with pytest.raises(TokenizerError, match="merge 1 .* not in the vocabulary"):
        build_tokenizer("GPT2BPETokenizer", tiny_files[0], str(unknown_part))
    vocab = tiny_vocab()
    del vocab[EOD_TOKEN]
    no_eod = write_tokenizer(tmp_path, vocab, TINY_MERGES)
    with pytest.raises(TokenizerError, match="has no <\\|endoftext\\|>"):
        build_tokenizer("GPT2BPETokenizer", *no_eod)
