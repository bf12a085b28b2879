"""The token ids of the data against the tokenizer's vocabulary, through pretrain_gpt.py: a dataset whose
dtype cannot hold the vocabulary, or whose sampled ids fall outside it, stops the run before any process
group with one line naming the file; an id the open-time sample misses stops it when its sample is read,
again with one line naming the file, and nothing is saved.
"""
import numpy as np
import pytest

from megatron.core.data.indexed_dataset import (IndexedDatasetBuilder, MMapIndexedDataset, data_file_path,
                                                index_file_path)
from tests.training.e2e_utils import TOKENIZER_VOCAB_SIZE, run_pretrain, tiny_gpt_flags

pytestmark = pytest.mark.distributed

RUN_FLAGS = ["--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
             "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1"]
STARTED = "> initializing torch distributed"
DTYPE_CODE_OFFSET = 17  # the .idx header: magic (9 bytes), version (8), then the dtype code (1)
FLOAT64_CODE = 7


def write_copy(source_prefix: str, prefix: str, dtype, change_ids=None) -> None:
    """The documents of ``source_prefix`` written to ``prefix`` as ``dtype``, each item passed through
    ``change_ids(ids) -> ids`` first when given."""
    source = MMapIndexedDataset(source_prefix)
    with IndexedDatasetBuilder(data_file_path(prefix), dtype) as builder:
        for document in range(len(source.doc_idx) - 1):
            for item in range(source.doc_idx[document], source.doc_idx[document + 1]):
                ids = np.array(source[item], dtype=np.int64)
                builder.add_item(ids if change_ids is None else change_ids(ids))
            builder.end_document()
        builder.finalize(index_file_path(prefix))


def run_on(data, prefix: str, tmp_path, num_workers: int = 0):
    flags = tiny_gpt_flags(data) + RUN_FLAGS + ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    flags[flags.index("--data-path") + 1] = prefix
    flags[flags.index("--num-workers") + 1] = str(num_workers)
    result = run_pretrain(flags, nproc=1)
    errors = [line for line in result.output.splitlines() if "pretrain_gpt.py: error:" in line]
    assert result.returncode != 0 and len(errors) == 1, result.output[-3000:]
    assert "Traceback" not in result.output, result.output[-3000:]
    assert not (tmp_path / "ckpt").exists()
    return result, errors[0]


def test_a_changed_dtype_code_is_named_before_anything_starts(e2e_data, tmp_path):
    prefix = str(tmp_path / "float_text_document")
    write_copy(e2e_data.data_prefix, prefix, np.int64)
    with open(index_file_path(prefix), "r+b") as index:  # int64 -> float64: the same size, so the .bin fits
        index.seek(DTYPE_CODE_OFFSET)
        index.write(bytes([FLOAT64_CODE]))
    result, error = run_on(e2e_data, prefix, tmp_path)
    assert result.returncode == 2 and STARTED not in result.output
    assert f"--data-path: {prefix}.idx: tokens are stored as float64 (dtype code 7), which is not an integer type" \
        in error and f"the tokenizer has {TOKENIZER_VOCAB_SIZE} tokens" in error


def test_ids_of_another_tokenizer_are_named_before_anything_starts(e2e_data, tmp_path):
    prefix = str(tmp_path / "other_text_document")
    write_copy(e2e_data.data_prefix, prefix, np.uint16, lambda ids: ids + TOKENIZER_VOCAB_SIZE)
    result, error = run_on(e2e_data, prefix, tmp_path)
    assert result.returncode == 2 and STARTED not in result.output
    assert f"--data-path: {prefix}.bin: token id " in error
    assert f"is outside the tokenizer's vocabulary [0, {TOKENIZER_VOCAB_SIZE})" in error


def test_an_id_the_sample_misses_is_named_when_read(e2e_data, tmp_path):
    """Ids past the 16th of every item are out of the vocabulary (and of the padded one): the open-time
    sample reads only the first 16 of each, the first training sample holds some. It is read by a
    DataLoader worker, whose traceback stays out of the line."""
    prefix = str(tmp_path / "late_text_document")

    def spoil_the_tail(ids):
        ids[16:] = 5000
        return ids

    write_copy(e2e_data.data_prefix, prefix, np.uint16, spoil_the_tail)
    result, error = run_on(e2e_data, prefix, tmp_path, num_workers=1)
    assert result.returncode == 1 and STARTED in result.output
    assert f"error: {prefix}.bin: sample " in error
    assert f", 5000], outside the tokenizer's vocabulary [0, {TOKENIZER_VOCAB_SIZE})" in error
