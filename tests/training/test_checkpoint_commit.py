"""A rank killed in the middle of a save never leaves ``latest`` pointing at a partial checkpoint.

Two processes (DP=2) save at iterations 2 and 4; at 4, rank 1 dies while writing its files, after
rank 0 has finished its own (tests/training/crash_during_save.py). ``latest`` and
``latest_checkpointed_iteration.txt`` must still name iteration 2, and a new run resumes from it
and saves iteration 4 properly. Then 12 runs are SIGKILLed at random moments of their saves.
"""
import os
import random
import re
import time

import pytest

from megatron.core.checkpoint.manifest import read_manifest
from megatron.training.checkpoint_checks import SAVING_MARKER
from tests.training.e2e_utils import start_ranks
from tests.training.pretrain_helpers import run_pretrain, tiny_run_args, training_lines

CRASHING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crash_during_save.py")
FLAGS = ["--global-batch-size", "4", "--train-iters", "4", "--lr-warmup-iters", "1", "--eval-iters", "0",
         "--save-interval", "2"]


@pytest.mark.slow
@pytest.mark.distributed
def test_rank_killed_during_save_leaves_the_previous_checkpoint_current(preprocessed_corpus, tmp_path):
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


def assert_complete(tag_directory):
    """Every file the manifest lists is there with its size and CRC-32, and the save's mark is gone."""
    manifest = read_manifest(str(tag_directory))
    assert manifest is not None and not (tag_directory / SAVING_MARKER).exists()
    manifest.check_present(str(tag_directory))
    for name in manifest.files:
        manifest.verify_file(str(tag_directory / name), str(tag_directory))


@pytest.mark.slow
@pytest.mark.distributed
def test_sigkill_at_random_moments_of_saves_always_leaves_a_resumable_checkpoint(preprocessed_corpus, tmp_path):
    """12 runs, one after the other, each resuming the last and SIGKILLed (both ranks at once) at a
    random moment while it saves every iteration: every start resumes from the checkpoint ``latest``
    names, which is always complete."""
    checkpoint = tmp_path / "ckpt"
    args = tiny_run_args(preprocessed_corpus, "--global-batch-size", "4", "--train-iters", "100000",
                         "--lr-warmup-iters", "1", "--eval-iters", "0", "--save-interval", "1",
                         "--save", str(checkpoint), "--load", str(checkpoint))
    rng = random.Random(20261123)
    resumed_from = []
    for trial in range(12):
        before = (checkpoint / "latest").read_text() if (checkpoint / "latest").exists() else None
        job = start_ranks(args)
        if before is not None:
            job.wait_for(rf"successfully loaded checkpoint from {re.escape(str(checkpoint))} at iteration "
                         rf"{before[len('global_step'):]}$")
            resumed_from.append(before)
        job.wait_for(r"^saving checkpoint at iteration")
        time.sleep(rng.uniform(0.0, 1.5))
        job.kill()
        if (checkpoint / "latest").exists():
            assert_complete(checkpoint / (checkpoint / "latest").read_text())
    assert len(resumed_from) >= 11 and len(set(resumed_from)) >= 5, resumed_from
