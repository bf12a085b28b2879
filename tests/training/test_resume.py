"""Resume: a run restarted from its iteration-4 checkpoint continues exactly where it stood.

The uninterrupted run trains 8 iterations and saves at 4 and 8; its global_step4 is copied into a
fresh directory whose ``latest`` names it, and a second run resumes from there. Counters, learning
rate, data position and, with dropout on, the RNG streams must continue: iterations 5-8 print the
same consumed samples/tokens and learning rates, and the same losses (bit-exact here; the test
allows fp32 noise), and the validation set continues where it stood.
"""
import os
import re
import shutil

import pytest
import torch

from tests.training.pretrain_helpers import (run_pretrain, tiny_run_args,
                                             training_lines, validation_lines)

FLAGS = ["--global-batch-size", "4", "--train-iters", "8", "--lr-warmup-iters", "2", "--hidden-dropout", "0.1",
         "--attention-dropout", "0.1", "--eval-interval", "4", "--eval-iters", "1", "--save-interval", "4"]


@pytest.fixture(scope="module")
def uninterrupted(preprocessed_corpus, tmp_path_factory):
    directory = tmp_path_factory.mktemp("uninterrupted")
    output = run_pretrain(tiny_run_args(preprocessed_corpus, *FLAGS, "--save", str(directory / "ckpt"))).stdout
    return output, directory / "ckpt"


def _checkpoint_at_4(source, destination):
    (destination / "global_step4").parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source / "global_step4", destination / "global_step4")
    (destination / "latest").write_text("global_step4")
    return destination


def test_resumed_run_continues_counters_lr_data_and_losses(preprocessed_corpus, uninterrupted, tmp_path):
    output, ckpt = uninterrupted
    resume_dir = _checkpoint_at_4(ckpt, tmp_path / "resume")
    resumed = run_pretrain(tiny_run_args(preprocessed_corpus, *FLAGS, "--load", str(resume_dir),
                                         "--save", str(resume_dir))).stdout
    assert f"successfully loaded checkpoint from {resume_dir} at iteration 4" in resumed
    # the manifest's cost, measured at every save and load: 5 files (layers 1, 3, 4 and 6, the model states)
    assert re.search(r"^  manifest: 5 files, [\d.]+ GB flushed and checksummed in [\d.]+ s \(slowest rank\) of the "
                     r"save's [\d.]+ s$", output, re.MULTILINE)
    assert re.search(r"^  verified \d+ files \([\d.]+ GB\) against the manifest in [\d.]+ s$", resumed, re.MULTILINE)
    reference = {line["iteration"]: line for line in training_lines(output)}
    continued = training_lines(resumed)
    assert [line["iteration"] for line in continued] == [5, 6, 7, 8]
    for line in continued:
        expected = reference[line["iteration"]]
        for key in ("consumed samples", "consumed tokens", "learning rate", "global batch size"):
            assert line[key] == expected[key], (line["iteration"], key)
        assert line["lm loss"] == pytest.approx(expected["lm loss"], rel=1e-6)
        assert line["grad norm"] == pytest.approx(expected["grad norm"], abs=1e-3)
    # the validation set continues: the evaluations after the restart see the same batches
    assert validation_lines(resumed) == validation_lines(output)[1:]
    final = torch.load(resume_dir / "global_step8" / "mp_rank_00_model_states.pt", weights_only=False)
    assert final["consumed_train_samples"] == 32 and final["consumed_valid_samples"] == 2 * 4  # evaluations at 4 and 8


def test_finetune_restarts_counters_and_schedule(preprocessed_corpus, uninterrupted, tmp_path):
    output, ckpt = uninterrupted
    resume_dir = _checkpoint_at_4(ckpt, tmp_path / "finetune")
    flags = ["--global-batch-size", "4", "--train-iters", "2", "--lr-warmup-iters", "1", "--eval-iters", "0",
             "--load", str(resume_dir), "--finetune", "--save", str(resume_dir), "--save-interval", "2"]
    refused = run_pretrain(tiny_run_args(preprocessed_corpus, *flags), check=False)
    assert refused.returncode != 0 and "--finetune restarts at iteration 0" in refused.stdout
    resumed = run_pretrain(tiny_run_args(preprocessed_corpus, *flags, "--overwrite-checkpoints")).stdout
    lines = training_lines(resumed)
    assert [(line["iteration"], line["consumed samples"]) for line in lines] == [(1, 4), (2, 8)]
    assert lines[0]["learning rate"] == pytest.approx(1e-3)  # a fresh schedule: warmup of 4 samples done
    # the weights were loaded: the first loss is the trained model's, lower than the untrained start
    assert lines[0]["lm loss"] < training_lines(output)[0]["lm loss"] - 0.02
    assert (resume_dir / "latest").read_text().strip() == "global_step2"


def test_no_load_optim_keeps_the_schedule_and_counters(preprocessed_corpus, uninterrupted, tmp_path):
    output, ckpt = uninterrupted
    resume_dir = _checkpoint_at_4(ckpt, tmp_path / "no_optim")
    resumed = run_pretrain(tiny_run_args(preprocessed_corpus, *FLAGS, "--load", str(resume_dir), "--no-load-optim",
                                         "--train-iters", "8", "--save", str(resume_dir))).stdout
    reference = {line["iteration"]: line for line in training_lines(output)}
    lines = training_lines(resumed)
    assert [line["iteration"] for line in lines] == [5, 6, 7, 8]
    assert [line["learning rate"] for line in lines] == [reference[i]["learning rate"] for i in (5, 6, 7, 8)]
    # iteration 5's loss is computed before its step, on the loaded weights; then fresh Adam moments diverge
    assert lines[0]["lm loss"] == pytest.approx(reference[5]["lm loss"], rel=1e-6)
    assert lines[1]["lm loss"] != pytest.approx(reference[6]["lm loss"], rel=1e-6)


def test_missing_load_directory_starts_from_scratch(preprocessed_corpus, tmp_path):
    flags = ["--global-batch-size", "4", "--train-iters", "1", "--eval-iters", "0"]
    output = run_pretrain(tiny_run_args(preprocessed_corpus, *flags, "--load", str(tmp_path / "absent"))).stdout
    assert f"no checkpoint found in --load {tmp_path / 'absent'}" in output
    assert [line["iteration"] for line in training_lines(output)] == [1]


@pytest.mark.parametrize("source", [None, "--override-lr-scheduler", "--use-checkpoint-lr-scheduler"])
def test_a_changed_learning_rate_on_resume(preprocessed_corpus, uninterrupted, tmp_path, source):
    """--lr 2e-3 instead of 1e-3 when resuming at iteration 4 (global batch 4, warmup 8 samples, linear decay
    to 0 at 32 samples): refused without a flag; --override-lr-scheduler continues the progress with the
    new peak, lr(n) = 2e-3 (1 - (n - 8) / 24) before the step of sample n; --use-checkpoint-lr-scheduler
    keeps the checkpoint's 1e-3, the uninterrupted run's rates."""
    output, ckpt = uninterrupted
    resume_dir = _checkpoint_at_4(ckpt, tmp_path / "changed")
    flags = [*FLAGS, "--lr", "2e-3", "--load", str(resume_dir), "--save", str(resume_dir)] + ([source] if source else [])
    result = run_pretrain(tiny_run_args(preprocessed_corpus, *flags), check=source is not None)
    if source is None:
        assert result.returncode != 0
        assert ("learning rate: checkpoint 0.001, configured 0.002 (--lr)" in result.stdout
                and "--override-lr-scheduler" in result.stdout and "--use-checkpoint-lr-scheduler" in result.stdout)
        return
    assert "> learning-rate schedule, learning rate: checkpoint 0.001, configured 0.002 (--lr): using" in result.stdout
    rates = [line["learning rate"] for line in training_lines(result.stdout)]
    if source == "--override-lr-scheduler":
        assert rates == pytest.approx([2e-3 * (1 - (4 * i - 8) / 24) for i in (5, 6, 7, 8)], rel=1e-3)
    else:
        reference = {line["iteration"]: line["learning rate"] for line in training_lines(output)}
        assert rates == [reference[i] for i in (5, 6, 7, 8)]


def test_save_schedule_and_retention(preprocessed_corpus, tmp_path):
    """12 iterations, --save-interval 4 with every 2nd iteration in 1-6, keeping the last 2 checkpoints and
    the one of iteration 2: saves at 2, 4, 6 (the range), 8 and 12 (every 4th; 12 is also the end);
    after each save only the last two and the pinned one remain."""
    flags = ["--global-batch-size", "4", "--train-iters", "12", "--eval-iters", "0", "--save", str(tmp_path / "ckpt"),
             "--save-interval", "4", "--save-interval-ranges", "1-6:2", "--keep-last-checkpoints", "2",
             "--pin-checkpoints", "2"]
    output = run_pretrain(tiny_run_args(preprocessed_corpus, *flags)).stdout
    saved = [int(line.split()[4]) for line in output.splitlines() if line.startswith("saving checkpoint at iteration")]
    assert saved == [2, 4, 6, 8, 12]
    removed = [line.split()[1].rstrip(",") for line in output.splitlines() if line.startswith("  removed ")]
    assert removed == ["global_step4", "global_step6"]  # after the saves of 8 and 12
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["global_step12", "global_step2", "global_step8", "latest",
                                                    "latest_checkpointed_iteration.txt"]
