"""Divergence controls, end to end on one CPU process (fp32): skipped iteration ranges and NaN iterations
make no update, advance the counters, are counted, and leave the same weights (dropout 0: a NaN
iteration runs its forward, a skipped one does not, so dropout masks would differ afterwards).

Run "skip" skips iterations 3-4 and 6 (--skip-train-iteration-range 3-4 6-6); run "nan" has a NaN loss
(hence NaN gradients) in the same iterations (tests/training/inject_nan.py). Both must end with the same
weights, bit for bit, and both differ from the run that skips nothing.
"""
import os

import pytest
import torch

from tests.training.pretrain_helpers import run_pretrain, tiny_run_args, training_lines

INJECT_NAN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "inject_nan.py")
GLOBAL_BATCH, ITERATIONS, SKIPPED = 4, 8, (3, 4, 6)
# Linear decay from 1e-3 to 0 over 32 samples, no warmup: lr = 1e-3 (1 - n / 32) after n applied samples.
FLAGS = ["--global-batch-size", str(GLOBAL_BATCH), "--train-iters", str(ITERATIONS), "--eval-iters", "0",
         "--save-interval", str(ITERATIONS), "--hidden-dropout", "0", "--attention-dropout", "0"]

pytestmark = [pytest.mark.slow]


def run(corpus, directory, *extra, nan_iterations=None, check=True):
    args = tiny_run_args(corpus, *FLAGS, "--save", str(directory), *extra)
    if nan_iterations is None:
        return run_pretrain(args, check=check)
    return run_pretrain(args, check=check, script=INJECT_NAN,
                        env={"NAN_ITERATIONS": ",".join(map(str, nan_iterations)), "MICRO_BATCHES": "2"})


def weights(directory):
    found = {}
    for name in sorted(os.listdir(directory / f"global_step{ITERATIONS}")):
        if name.startswith("layer_"):
            state = torch.load(directory / f"global_step{ITERATIONS}" / name, weights_only=False)
            found.update({f"{name}:{key}": value for key, value in state.items()})
    return found


@pytest.fixture(scope="module")
def runs(preprocessed_corpus, tmp_path_factory):
    base = tmp_path_factory.mktemp("divergence")
    outputs = {"plain": run(preprocessed_corpus, base / "plain").stdout,
               "skip": run(preprocessed_corpus, base / "skip", "--skip-train-iteration-range", "6-6", "3-4").stdout,
               "nan": run(preprocessed_corpus, base / "nan", nan_iterations=SKIPPED).stdout}
    return base, outputs


def test_skipped_iterations_advance_the_counters_and_are_counted(runs):
    _, outputs = runs
    lines = training_lines(outputs["skip"])
    assert [line["iteration"] for line in lines] == list(range(1, ITERATIONS + 1))
    assert [line["consumed samples"] for line in lines] == [GLOBAL_BATCH * i for i in range(1, ITERATIONS + 1)]
    assert [line["number of skipped iterations"] for line in lines] == [1 if i in SKIPPED else 0
                                                                        for i in range(1, ITERATIONS + 1)]
    assert all(("lm loss" in line) == (line["iteration"] not in SKIPPED) for line in lines)
    assert all(line["number of nan iterations"] == 0 for line in lines)
    applied = [sum(1 for i in range(1, k + 1) if i not in SKIPPED) for k in range(1, ITERATIONS + 1)]
    assert [line["learning rate"] for line in lines] == pytest.approx([1e-3 * (1 - GLOBAL_BATCH * a / 32)
                                                                       for a in applied], abs=6e-7)
    assert outputs["skip"].count("Skipped iterations 3 to 4 due to --skip-train-iteration-range flag.") == 1
    assert outputs["skip"].count("Skipped iterations 6 to 6 due to --skip-train-iteration-range flag.") == 1


def test_nan_iterations_make_no_update_and_are_counted(runs):
    _, outputs = runs
    lines = {line["iteration"]: line for line in training_lines(outputs["nan"])}
    for iteration in range(1, ITERATIONS + 1):
        nan = iteration in SKIPPED
        assert lines[iteration]["number of skipped iterations"] == lines[iteration]["number of nan iterations"] == nan
    skip = {line["iteration"]: line for line in training_lines(outputs["skip"])}
    for iteration in set(range(1, ITERATIONS + 1)) - set(SKIPPED):
        assert lines[iteration]["lm loss"] == skip[iteration]["lm loss"]
        assert lines[iteration]["learning rate"] == skip[iteration]["learning rate"]


def test_skipping_and_nan_leave_the_same_weights(runs):
    base, _ = runs
    skipped, nan, plain = weights(base / "skip"), weights(base / "nan"), weights(base / "plain")
    assert skipped.keys() == nan.keys() == plain.keys() and skipped
    assert all(torch.equal(skipped[key], nan[key]) for key in skipped)
    assert not all(torch.equal(skipped[key], plain[key]) for key in skipped)


def test_consecutive_nan_iterations_save_and_stop(preprocessed_corpus, tmp_path):
    result = run(preprocessed_corpus, tmp_path / "ckpt", "--max-consecutive-nan-iterations", "2",
                 nan_iterations=range(3, ITERATIONS + 1), check=False)
    assert result.returncode != 0
    assert ("2 iterations in a row (up to 4) had a NaN or Inf loss or gradient norm and made no update "
            "(--max-consecutive-nan-iterations 2); the checkpoint at iteration 4") in result.stdout
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step4"
    assert [line["iteration"] for line in training_lines(result.stdout)] == [1, 2, 3, 4]
