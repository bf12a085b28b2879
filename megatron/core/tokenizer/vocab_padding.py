"""Padded vocabulary size: the embedding's row count, rounded for efficient and even TP splits."""
from megatron.core.tokenizer.bpe_files import TokenizerError


def vocab_size_with_padding(orig_vocab_size, make_vocab_size_divisible_by=128,
                            tensor_model_parallel_size=1, pad_vocab_size_to=None):
    """Padded vocabulary size V_p, as Megatron-DeepSpeed computes it.

    With ``pad_vocab_size_to`` P:  V_p = P, which must satisfy P >= V and P % d == 0
    (d = ``make_vocab_size_divisible_by``; divisibility by TP is checked where the embedding is
    split). Otherwise:  V_p = ceil(V / (d * TP)) * (d * TP), so V_p depends on the TP size.
    Example: V = 50257, d = 128 gives 50304 at TP 1 and 50432 at TP 2.
    The original size V is kept by callers for conversion tools (checkpoint_info).
    """
    _check_positive(orig_vocab_size, "the original vocabulary size")
    _check_positive(make_vocab_size_divisible_by, "--make-vocab-size-divisible-by")
    _check_positive(tensor_model_parallel_size, "--tensor-model-parallel-size")
    if pad_vocab_size_to is not None:
        if pad_vocab_size_to < orig_vocab_size:
            raise TokenizerError(
                f"--pad-vocab-size-to {pad_vocab_size_to} is smaller than the vocabulary "
                f"({orig_vocab_size} tokens); you can only pad to a larger size")
        if pad_vocab_size_to % make_vocab_size_divisible_by != 0:
            raise TokenizerError(
                f"--pad-vocab-size-to {pad_vocab_size_to}: {pad_vocab_size_to} is not divisible "
                f"by {make_vocab_size_divisible_by} (--make-vocab-size-divisible-by)")
        return pad_vocab_size_to
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-orig_vocab_size // multiple) * multiple


def _check_positive(value, name):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TokenizerError(f"{name} must be a positive integer, got {value!r}")
