"""The checkpoint the evaluation tests read: the tiny GPT of test_layout_equivalence (fp32, dropout
0, padded vocabulary 1152 for a 1000-token tokenizer, 80 positions), 2 layers, sequence 32, trained 2 iterations
under TP=2 x PP=2 (4 gloo processes) and saved; a session fixture (``trained``, registered in tests/conftest.py)."""
import os

import pytest

from tests.training.e2e_utils import E2EData, run_pretrain
from tests.training.test_layout_equivalence import MAX_POSITIONS, common_flags

SEQ_LENGTH, NUM_LAYERS = 32, 2
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def model_flags(data: E2EData) -> list[str]:
    """The model and tokenizer flags of the checkpoint, as an evaluation command line repeats them."""
    return ["--num-layers", str(NUM_LAYERS), "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", str(SEQ_LENGTH), "--max-position-embeddings", str(MAX_POSITIONS),
            "--pad-vocab-size-to", "1152", "--vocab-file", data.vocab_file, "--merge-file", data.merge_file]


@pytest.fixture(scope="session")
def trained(e2e_data, tmp_path_factory) -> tuple[E2EData, str]:
    """(the corpus and tokenizer, the --save directory of the TP=2 x PP=2 run)."""
    save = str(tmp_path_factory.mktemp("evaluated") / "checkpoints")
    flags = common_flags(e2e_data, seq_length=SEQ_LENGTH, num_layers=NUM_LAYERS, global_batch=4, train_iters=2)
    run_pretrain(flags + TP2_PP2 + ["--zero-stage", "1", "--save", save, "--save-interval", "2"], nproc=4,
                 timeout=600).assert_ok()
    return e2e_data, save


def checkpoint_path(save: str) -> str:
    return os.path.join(save, "global_step2")
