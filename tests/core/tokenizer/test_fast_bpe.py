"""Fast-path selection: rank-table checks, rank -> id remapping, fallbacks, Unicode guard."""
import random

import numpy as np
import pytest

from megatron.core.tokenizer import GPT2BPETokenizer, TokenizerError
from megatron.core.tokenizer.fast_bpe import (RankTableError, TiktokenBPE,
                                              has_unstable_characters, rank_table)
from megatron.core.tokenizer.gpt2_bpe import EOD_TOKEN, ReferenceBPE, bytes_to_unicode
from tests.core.tokenizer.test_gpt2_bpe import (TINY_CASES, TINY_MERGES, tiny_vocab,
                                                write_tokenizer)

PROBE_TEXTS = list(TINY_CASES) + ["It's the  café\n\n😀 <|endoftext|> we're", "the the  the"]


def checked_rank_table(vocab, merges):
    return rank_table(vocab, merges, ReferenceBPE(vocab, merges).merge_pieces)


def reference_ids(files, texts):
    reference = GPT2BPETokenizer(*files, use_fast=False)
    return [reference.tokenize(text) for text in texts]


def test_rank_table_of_gpt2_layout_is_the_identity():
    ranks, rank_to_id = checked_rank_table(tiny_vocab(), TINY_MERGES)
    assert np.array_equal(rank_to_id, np.arange(256 + len(TINY_MERGES)))
    assert ranks[b"!"] == 0 and ranks[b"\n"] == 198 and ranks[b" "] == 220
    assert ranks[b" the"] == 258 and ranks[b"\xf0\x9f"] == 267
    assert len(ranks) == 256 + len(TINY_MERGES)


def test_permuted_ids_use_a_rank_to_id_table(tmp_path):
    """eod first and the byte ids reversed: tiktoken ranks must be mapped back to these ids."""
    layout = tiny_vocab()
    tokens = [EOD_TOKEN] + list(reversed(list(bytes_to_unicode().values()))) + \
        [left + right for left, right in TINY_MERGES]
    permuted = {token: index for index, token in enumerate(tokens)}
    assert set(permuted) == set(layout)
    files = write_tokenizer(tmp_path, permuted, TINY_MERGES)
    fast = GPT2BPETokenizer(*files)
    assert fast.fast_path_reason == "tiktoken (rank -> id table)" and fast.eod == 0
    assert fast.tokenize_batch(PROBE_TEXTS) == reference_ids(files, PROBE_TEXTS)
    assert fast.tokenize(" the") == [permuted[" the".replace(" ", "Ġ")]]


def test_duplicate_merge_results_fall_back_to_hf_tokenizers(tmp_path):
    """'Ġt'+'he' and 'Ġth'+'e' both give 'Ġthe': tiktoken merges by result, so it is refused."""
    merges = TINY_MERGES[:2] + [("Ġt", "h"), ("Ġth", "e"), ("Ġt", "he")] + TINY_MERGES[3:]
    vocab = tiny_vocab()
    vocab["Ġth"] = len(vocab)
    with pytest.raises(RankTableError, match="duplicate merge results"):
        checked_rank_table(vocab, merges)
    files = write_tokenizer(tmp_path, vocab, merges)
    tokenizer = GPT2BPETokenizer(*files)
    assert tokenizer.is_fast and tokenizer.fast_path_reason.startswith("HF tokenizers")
    assert "duplicate merge results" in tokenizer.fast_path_reason
    assert tokenizer.tokenize_batch(PROBE_TEXTS) == reference_ids(files, PROBE_TEXTS)


def test_missing_bytes_fall_back(tmp_path):
    vocab = tiny_vocab()
    del vocab[bytes_to_unicode()[0xFF]]  # never occurs in UTF-8 text
    vocab = {token: index for index, token in enumerate(vocab)}
    with pytest.raises(RankTableError, match="1 of the 256 byte tokens are missing"):
        checked_rank_table(vocab, TINY_MERGES)
    files = write_tokenizer(tmp_path, vocab, TINY_MERGES)
    tokenizer = GPT2BPETokenizer(*files)
    assert "byte tokens are missing" in tokenizer.fast_path_reason
    assert tokenizer.tokenize_batch(PROBE_TEXTS) == reference_ids(files, PROBE_TEXTS)


def test_merge_of_a_later_token_is_refused():
    merges = [("Ġt", "he"), ("Ġ", "t"), ("h", "e")]
    with pytest.raises(RankTableError, match="merge 0 .* not a byte or the result of an earlier"):
        checked_rank_table(tiny_vocab(), merges)


def test_merge_result_the_reference_cannot_reach_is_refused(tmp_path):
    """'cbb' = 'cb'+'b', but the reference merges 'b b' (rank 0) first and stops at 'c' 'bb'.

    tiktoken would take the piece "cbb" as the token 'cbb', so such files must not use it.
    """
    merges = [("b", "b"), ("c", "b"), ("cb", "b")]
    vocab = {char: index for index, char in enumerate(bytes_to_unicode().values())}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    vocab[EOD_TOKEN] = len(vocab)
    with pytest.raises(RankTableError, match="merge 2 .*the reference encodes 'cbb' as "
                                             "\\['c', 'bb'\\]"):
        checked_rank_table(vocab, merges)
    unchecked = TiktokenBPE(*rank_table(vocab, merges, merge_pieces=lambda word: ["".join(word)]))
    assert unchecked.encode("cbb") == [vocab["cbb"]]
    files = write_tokenizer(tmp_path, vocab, merges)
    tokenizer = GPT2BPETokenizer(*files)
    assert tokenizer.fast_path_reason.startswith("HF tokenizers")
    assert tokenizer.tokenize("cbb") == [vocab["c"], vocab["bb"]]
    texts = ["cbb cbbb bbcb cbcbb", "xcbbx", "bcbbbcbcbbbb"]
    assert tokenizer.tokenize_batch(texts) == reference_ids(files, texts)


def test_forcing_the_fast_path_without_one_is_an_error(tmp_path, monkeypatch):
    vocab = tiny_vocab()
    del vocab[bytes_to_unicode()[0xFF]]
    vocab = {token: index for index, token in enumerate(vocab)}
    files = write_tokenizer(tmp_path, vocab, TINY_MERGES)
    monkeypatch.setattr("megatron.core.tokenizer.fast_bpe.HFTokenizersBPE.encode",
                        lambda self, text: [0])
    assert not GPT2BPETokenizer(*files).is_fast
    with pytest.raises(TokenizerError, match="use_fast=True but no fast path.*probe text"):
        GPT2BPETokenizer(*files, use_fast=True)


def test_extra_vocabulary_tokens_are_never_produced(tmp_path):
    """A token no merge builds (here 'the') is left out of tiktoken's ranks, like the reference."""
    vocab = tiny_vocab()
    vocab["the"] = len(vocab)
    files = write_tokenizer(tmp_path, vocab, TINY_MERGES)
    fast = GPT2BPETokenizer(*files)
    assert fast.fast_path_reason == "tiktoken (ids = ranks)"
    assert fast.tokenize("the") == [83, 257]
    assert fast.tokenize_batch(PROBE_TEXTS) == reference_ids(files, PROBE_TEXTS)


def test_unstable_characters():
    assert not has_unstable_characters("plain ascii")
    assert not has_unstable_characters("café 日本語 😀 Привет")
    assert has_unstable_characters("new \U000e01f0 char")  # unassigned (Cn)
    assert has_unstable_characters("\ud800")  # lone surrogate (Cs)



def random_merges(rng, reachable_only):
    """40 merges over 'a', 'b', 'c' with unique results; ``reachable_only`` keeps just those the
    reference makes of their own bytes (as training does)."""
    tokens, merges = ["a", "b", "c"], []
    while len(merges) < 40:
        left, right = rng.choice(tokens), rng.choice(tokens)
        if left + right in tokens or len(left + right) > 6:
            continue
        if reachable_only:
            reference = ReferenceBPE(dict.fromkeys(tokens + [left + right], 0),
                                     merges + [(left, right)])
            if reference.merge_pieces(list(left + right)) != [left + right]:
                continue
        merges.append((left, right))
        tokens.append(left + right)
    return merges


def test_random_merge_lists_encode_like_the_reference(tmp_path):
    """Whichever path a random merge list gets, ids equal the reference's on random strings."""
    rng = random.Random(1234)
    chosen = []
    for trial in range(24):
        merges = random_merges(rng, reachable_only=trial % 2 == 0)
        vocab = {char: index for index, char in enumerate(bytes_to_unicode().values())}
        for left, right in merges:
            vocab[left + right] = len(vocab)
        vocab[EOD_TOKEN] = len(vocab)
        directory = tmp_path / str(trial)
        directory.mkdir()
        files = write_tokenizer(directory, vocab, merges)
        texts = [" ".join("".join(rng.choice("abc") for _ in range(rng.randint(1, 12)))
                          for _ in range(20)) for _ in range(20)]
        tokenizer = GPT2BPETokenizer(*files)
        chosen.append(tokenizer.fast_path_reason.split(" ")[0])
        assert tokenizer.tokenize_batch(texts) == reference_ids(files, texts), merges
    assert chosen[::2] == ["tiktoken"] * 12 and "HF" in chosen[1::2]


def test_checks_run_once_per_file_contents(tmp_path, monkeypatch):
    calls = []
    original = rank_table

    def counting_rank_table(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr("megatron.core.tokenizer.fast_bpe.rank_table", counting_rank_table)
    merges = TINY_MERGES[:-1]  # contents no other test uses, so nothing is memoised yet
    vocab = {token: index for index, token in enumerate(tiny_vocab()) if token != "|>"}
    files = write_tokenizer(tmp_path, vocab, merges)
    first, second = GPT2BPETokenizer(*files), GPT2BPETokenizer(*files)
    assert len(calls) == 1 and first.is_fast and second.is_fast
    assert second.tokenize_batch(PROBE_TEXTS) == reference_ids(files, PROBE_TEXTS)
    write_tokenizer(tmp_path, vocab, merges[:-1])  # new contents at the same paths: checked again
    GPT2BPETokenizer(*files)
    assert len(calls) == 2
