"""A rank killed in the middle of a save never leaves ``latest`` pointing at a partial checkpoint, and
a save the disk refuses stops the run with one line, the previous checkpoint still current.

Two processes (DP=2) save at iterations 2 and 4; at 4, rank 1 dies while writing its files, after
rank 0 has finished its own (tests/training/crash_during_save.py). ``latest`` and
``latest_checkpointed_iteration.txt`` must still name iteration 2, and a new run resumes from it
and saves iteration 4 properly. Rank 0 killed while writing the save's first file (the
``saving.incomplete`` marker) leaves no global_stepN directory at all. The disk filling during the
save of iteration 4 (tests/training/full_disk_during_save.py), on one rank or on both, stops both
ranks with one line (shown once) naming ENOSPC, the file and global_step2, which stays current.
Then 12 runs are SIGKILLed at random moments of their saves.
"""
import os
import random
import re
import time

import pytest

from megatron.core.checkpoint.manifest import read_manifest
from megatron.training.checkpoint_checks import SAVING_MARKER, checkpoint_tags
from tests.training.e2e_utils import start_ranks
from tests.training.pretrain_helpers import run_pretrain, tiny_run_args, training_lines

CRASHING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "crash_during_save.py")
FILLING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "full_disk_during_save.py")
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


@pytest.mark.slow
@pytest.mark.distributed
def test_a_kill_while_marking_a_save_leaves_no_tag_directory(preprocessed_corpus, tmp_path):
    checkpoint = tmp_path / "ckpt"
    args = tiny_run_args(preprocessed_corpus, *FLAGS, "--save", str(checkpoint), "--keep-last-checkpoints", "1")
    crashed = run_pretrain(args, nproc=2, check=False, script=CRASHING, env={"CRASH_AT_MARKER": "global_step4"})
    assert crashed.returncode != 0, crashed.stdout[-3000:]
    assert sorted(os.listdir(checkpoint)) == [".global_step4.starting", "global_step2", "latest",
                                              "latest_checkpointed_iteration.txt"]
    assert checkpoint_tags(str(checkpoint)) == ["global_step2"]
    assert (checkpoint / "latest").read_text() == "global_step2"

    resumed = run_pretrain(args + ["--load", str(checkpoint)], nproc=2).stdout
    assert f"successfully loaded checkpoint from {checkpoint} at iteration 2" in resumed
    assert sorted(os.listdir(checkpoint)) == ["global_step4", "latest", "latest_checkpointed_iteration.txt"]
    assert_complete(checkpoint / "global_step4")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("ranks, capacity, failing", [("1", 0, "rank 1"), ("0,1", 20_000, "ranks 0, 1")],
                         ids=["one-rank", "every-rank-mid-file"])
def test_a_full_disk_stops_the_save_in_one_line_and_keeps_the_last_checkpoint(preprocessed_corpus, tmp_path, ranks,
                                                                              capacity, failing):
    checkpoint = tmp_path / "ckpt"
    args = tiny_run_args(preprocessed_corpus, *FLAGS, "--zero-stage", "1", "--save", str(checkpoint))  # a shard per rank
    full = run_pretrain(args, nproc=2, check=False, script=FILLING,
                        env={"FULL_AT_TAG": "global_step4", "FULL_ON_RANKS": ranks, "FULL_CAPACITY": str(capacity)})
    errors = [line for line in full.stdout.splitlines() if "pretrain_gpt.py: error: " in line]
    assert full.returncode != 0 and len(errors) == 1 and "Traceback" not in full.stdout, full.stdout[-3000:]
    assert (f"saving global_step4 to --save {checkpoint} failed: No space left on device (ENOSPC) writing "
            f"{checkpoint}/global_step4/") in errors[0]
    assert (f"({failing}); {checkpoint}/global_step2 stays the last complete checkpoint ('latest' names it); "
            f"global_step4 stays incomplete") in errors[0]
    assert "successfully saved checkpoint at iteration       2" in full.stdout
    assert (checkpoint / "latest").read_text() == "global_step2"
    assert (checkpoint / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    assert (checkpoint / "global_step4" / SAVING_MARKER).exists()
    assert checkpoint_tags(str(checkpoint)) == ["global_step2"]
    assert_complete(checkpoint / "global_step2")
    if ranks == "1":
        resumed = run_pretrain(args + ["--load", str(checkpoint)], nproc=2).stdout
        assert f"successfully loaded checkpoint from {checkpoint} at iteration 2" in resumed
        assert_complete(checkpoint / "global_step4")


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
