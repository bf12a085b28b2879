"""--sync-tp-duplicated-parameters on 2 gloo ranks at TP=2 (fp32): TP rank 1's copy of a layer norm weight is
pushed 1e-3 away before iteration 3 (tests/training/inject_tp_drift.py). With the flag the drift is reported,
naming the parameter, and both TP ranks save the same values, bit for bit; without it the copies stay apart.
An undisturbed run reports nothing."""
import os

import pytest
import torch

from tests.training.e2e_utils import run_ranks, tiny_gpt_flags

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

INJECT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "inject_tp_drift.py")
FLAGS = ["--tensor-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "4", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0", "--save-interval", "4"]
LAYER = "layer_03-model_0{}-model_states.pt"


def run(data, checkpoint, *extra, drift=True):
    command = [INJECT, *tiny_gpt_flags(data), *FLAGS, "--save", str(checkpoint), *extra]
    env = {"DRIFT_AT_ITERATION": "3", "DRIFT": "1e-3" if drift else "0"}
    result = run_ranks(command, 2, env=env)
    result.assert_ok()
    return result.output


def tp_copies(checkpoint):
    """The two TP ranks' input layer norm weight of the first layer, as saved at iteration 4."""
    return [torch.load(checkpoint / "global_step4" / LAYER.format(rank), weights_only=False)["input_layernorm.weight"]
            for rank in (0, 1)]


def test_drift_is_reported_and_removed(e2e_data, tmp_path):
    output = run(e2e_data, tmp_path / "synced", "--sync-tp-duplicated-parameters")
    reports = [line for line in output.splitlines() if "TP-duplicated parameters had drifted" in line]
    assert reports[0].startswith("> iteration 3:") and "3.input_layernorm.weight" in reports[0]
    assert "largest |difference| 1.000e-03" in reports[0]
    # Iteration 3's forward already ran on the nudged copy, so iteration 4 finds its echo in the gradients
    # of other duplicated parameters (about 1e-7) and removes it too.
    assert len(reports) <= 2 and all(line.startswith(("> iteration 3:", "> iteration 4:")) for line in reports)
    first, second = tp_copies(tmp_path / "synced")
    assert torch.equal(first, second)


def test_without_the_flag_the_copies_stay_apart(e2e_data, tmp_path):
    output = run(e2e_data, tmp_path / "apart")
    assert "had drifted" not in output
    first, second = tp_copies(tmp_path / "apart")
    assert (first - second).abs().max() == pytest.approx(1e-3, rel=1e-2)


def test_an_undisturbed_run_reports_no_drift(e2e_data, tmp_path):
    output = run(e2e_data, tmp_path / "calm", "--sync-tp-duplicated-parameters", drift=False)
    assert "had drifted" not in output
    first, second = tp_copies(tmp_path / "calm")
    assert torch.equal(first, second)
