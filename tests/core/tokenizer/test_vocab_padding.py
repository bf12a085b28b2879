"""Padded vocabulary: Megatron-DeepSpeed's rules for --make-vocab-size-divisible-by, --pad-vocab-size-to."""
import pytest

from megatron.core.tokenizer import TokenizerError, vocab_size_with_padding


def counted_up_padding(orig, divisible_by, tp):
    """Megatron-DeepSpeed's loop: count up until the size is a multiple of divisible_by * TP."""
    after = orig
    while after % (divisible_by * tp) != 0:
        after += 1
    return after


@pytest.mark.parametrize("orig, divisible_by, tp, expected", [
    (50257, 128, 1, 50304),
    (50257, 128, 2, 50432),
    (50257, 128, 4, 50688),
    (50257, 1, 1, 50257),
    (50304, 128, 1, 50304),
    (250680, 128, 4, 250880),
    (4096, 128, 8, 4096),
    (4097, 128, 8, 5120),
])
def test_round_up_to_divisible_by_times_tp(orig, divisible_by, tp, expected):
    assert vocab_size_with_padding(orig, divisible_by, tp) == expected


def test_matches_megatron_deepspeeds_loop():
    for orig in range(1, 700, 7):
        for divisible_by in (1, 8, 64, 128):
            for tp in (1, 2, 3, 4):
                assert vocab_size_with_padding(orig, divisible_by, tp) == \
                    counted_up_padding(orig, divisible_by, tp)


def test_pad_vocab_size_to():
    assert vocab_size_with_padding(250680, 128, 4, pad_vocab_size_to=250880) == 250880
    # pad-to overrides TP rounding and is only checked against divisible-by (as in Megatron-DeepSpeed).
    assert vocab_size_with_padding(50257, 128, 8, pad_vocab_size_to=50304) == 50304
    assert vocab_size_with_padding(5000, 128, 1, pad_vocab_size_to=5120) == 5120


def test_pad_vocab_size_to_errors():
    with pytest.raises(TokenizerError, match="--pad-vocab-size-to 5000 is smaller than the "
                                             "vocabulary \\(50257 tokens\\)"):
        vocab_size_with_padding(50257, 128, 1, pad_vocab_size_to=5000)
    with pytest.raises(TokenizerError, match="--pad-vocab-size-to 5121: 5121 is not divisible "
                                             "by 128"):
        vocab_size_with_padding(5000, 128, 1, pad_vocab_size_to=5121)


@pytest.mark.parametrize("arguments, flag", [
    ((0, 128, 1), "original vocabulary size"),
    ((100, 0, 1), "--make-vocab-size-divisible-by"),
    ((100, 128, 0), "--tensor-model-parallel-size"),
    ((100, 12.5, 1), "--make-vocab-size-divisible-by"),
])
def test_invalid_arguments(arguments, flag):
    with pytest.raises(TokenizerError, match=flag):
        vocab_size_with_padding(*arguments)
