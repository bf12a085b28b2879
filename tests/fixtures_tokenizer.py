"""Session fixtures: GPT-2-format tokenizer files trained on the sample corpus.

Registered for every test by ``pytest_plugins`` in ``tests/conftest.py``; request them by name.
Each fixture trains once per session with ``tools/train_tokenizer.py`` (about a second) and returns
``(vocab_file, merge_file)``. The vocabulary is in GPT-2's layout: ids 0..255 are the bytes, then
one token per merge, then ``<|endoftext|>`` as the last id.
"""
import pytest

from tests.conftest import SAMPLE_CORPUS
from tools.train_tokenizer import train_tokenizer

SMALL_VOCAB_SIZE = 4096
# GPT-2's size. The 3 MB sample corpus runs out of pairs first: it yields about 31.7k tokens.
LARGE_VOCAB_SIZE = 50257


def _train(tmp_path_factory, name, vocab_size):
    output_dir = tmp_path_factory.mktemp(name)
    summary = train_tokenizer([SAMPLE_CORPUS], str(output_dir), vocab_size=vocab_size)
    return summary["vocab_file"], summary["merge_file"]


@pytest.fixture(scope="session")
def gpt2_tokenizer_files(tmp_path_factory):
    """(vocab_file, merge_file) of a 4096-token byte-level BPE trained on the sample corpus."""
    return _train(tmp_path_factory, "gpt2_tokenizer_4k", SMALL_VOCAB_SIZE)


@pytest.fixture(scope="session")
def gpt2_tokenizer_files_50k(tmp_path_factory):
    """(vocab_file, merge_file) trained with --vocab-size 50257 (the corpus gives ~31.7k tokens)."""
    return _train(tmp_path_factory, "gpt2_tokenizer_50k", LARGE_VOCAB_SIZE)
