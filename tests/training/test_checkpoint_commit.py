"""A rank killed in the middle of a save never leaves ``latest`` pointing at a partial checkpoint.

Two processes (DP=2) save at iterations 2 and 4; at 4, rank 1 dies while writing its files, after
rank 0 has finished its own (tests/training/crash_during_save.py). ``latest`` and
``latest_checkpointed_iteration.txt`` must still name iteration 2, and a new run resumes from it
and saves iteration 4 properly.
"""
import os

import pytest

from tests.training.pretrain_helpers import preprocessed_corpus, run_pretrain, tiny_run_args, training_lines  # noqa: F401

CRASHING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crash_during_save.py")
FLAGS = ["--global-batch-size", "4", "--train-iters", "4", "--lr-warmup-iters", "1", "--eval-iters", "0",
         "--save-interval", "2"]


@pytest.mark.slow
@pytest.mark.distributed
def test_rank_killed_during_save_leaves_the_previous_checkpoint_current(preprocessed_corpus, tmp_path):  # noqa: F811
    checkpoint = tmp_path / "ckpt"
    args = tiny_run_args(preprocessed_corpus, *FLAGS, "--save", str(checkpoint))
    crashed = run_pretrain(args, nproc=2, check=False, script=CRASHING, env={"CRASH_AT_TAG": "global_step4"})
    assert crashed.returncode != 0, crashed.stdout[-3000:]
    assert "successfully saved checkpoint at iteration       2" in crashed.stdout
    assert "successfully saved checkpoint at iteration       4" not in crashed.stdout
    assert (checkpoint / "latest").read_text() == "global_step2"
    assert (checkpoint / "latest_checkpointed_iteration.txt").read_text() == "2\n"

    resumed = run_pretrain(tiny_run_args(preprocessed_corpus, *FLAGS, "--save", str(checkpoint),
                                         "--load", str(checkpoint)), nproc=2).stdout
    assert f"successfully loaded checkpoint from {checkpoint} at iteration 2" in resumed
    assert [line["iteration"] for line in training_lines(resumed)] == [3, 4]
    assert (checkpoint / "latest").read_text() == "global_step4"
    assert (checkpoint / "latest_checkpointed_iteration.txt").read_text() == "4\n"
