"""ZeRO-2 with the optimizer offloaded to the CPU, from the ds_config alone (the GPT-2 benchmark notes'
setting): DeepSpeed's CPU Adam runs the same AdamW update as ZeRO-2 without offload, so 5 iterations
give the same losses (fp32, 2 gloo processes), and a save at 3 resumes with the offloaded state.
DeepSpeed's zero_to_fp32.py, left beside these (plain-engine) checkpoints, rebuilds the weights; the
pipeline engine's checkpoints (ZeRO 0/1) do not get it, as it cannot read them (checked on the ZeRO-1
checkpoint of test_3d_parallel_cpu.py, which that module saves anyway).

The ZeRO-2 run without offload is launched once (a module fixture): its losses are the offloaded
run's reference and its final checkpoint is the one zero_to_fp32.py rebuilds.
"""
import json
import os
import subprocess
import sys

import torch

import pytest

from tests.training.e2e_utils import run_pretrain, tiny_gpt_flags

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TRAIN_ITERS = 5


def run_flags() -> list[str]:
    return ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(TRAIN_ITERS), "--lr", "1e-3",
            "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0", "--weight-decay", "0.1",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--use-cpu-initialization", "--deepspeed"]


def ds_config(directory, offload: bool) -> str:
    zero = {"stage": 2, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    path = directory / f"ds_offload_{offload}.json"
    path.write_text(json.dumps({"zero_optimization": zero, "gradient_clipping": 1.0}))
    return str(path)


def losses(result):
    return {line.iteration: line.number("lm loss") for line in result.log_lines()}


@pytest.fixture(scope="module")
def zero_2(e2e_data, tmp_path_factory):
    """ZeRO-2 without offload for TRAIN_ITERS iterations, saved at its end -> (run result, --save directory)."""
    directory = tmp_path_factory.mktemp("zero2")
    checkpoint = directory / "ckpt"
    result = run_pretrain(tiny_gpt_flags(e2e_data) + run_flags() + ["--deepspeed_config", ds_config(directory, False),
                                                                    "--save", str(checkpoint),
                                                                    "--save-interval", str(TRAIN_ITERS)], nproc=2)
    result.assert_ok()
    return result, checkpoint


def test_offload_gives_the_losses_of_zero_2_and_resumes(zero_2, e2e_data, tmp_path):
    plain, _ = zero_2
    flags = tiny_gpt_flags(e2e_data) + run_flags() + ["--deepspeed_config", ds_config(tmp_path, True)]
    offloaded = run_pretrain(flags + ["--save", str(tmp_path / "ckpt"), "--save-interval", "3"], nproc=2)
    offloaded.assert_ok()
    reference = losses(plain)
    assert sorted(reference) == [1, 2, 3, 4, 5]
    assert losses(offloaded) == pytest.approx(reference, rel=1e-5)

    (tmp_path / "ckpt" / "latest").write_text("global_step3")  # the run also saved at its end, iteration 5
    resumed = run_pretrain(flags + ["--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "resumed"),
                                    "--save-interval", "100"], nproc=2)
    resumed.assert_ok()
    assert "successfully loaded checkpoint" in resumed.output
    continued = losses(resumed)
    assert sorted(continued) == [4, 5] and continued == pytest.approx({4: reference[4], 5: reference[5]}, rel=1e-5)


def test_zero_to_fp32_works_where_it_is_written(zero_2, tmp_path):
    """The ZeRO-2 checkpoint carries zero_to_fp32.py, which rebuilds its module's weights exactly."""
    _, checkpoint = zero_2
    assert os.path.exists(checkpoint / "zero_to_fp32.py")
    subprocess.run([sys.executable, "zero_to_fp32.py", ".", str(tmp_path / "fp32")], cwd=checkpoint,
                   check=True, capture_output=True)
    rebuilt = torch.load(tmp_path / "fp32" / "pytorch_model.bin", weights_only=False)
    module = torch.load(checkpoint / f"global_step{TRAIN_ITERS}" / "mp_rank_00_model_states.pt",
                        weights_only=False)["module"]
    assert sorted(rebuilt) == sorted(module) and all(torch.equal(rebuilt[k], module[k].float()) for k in rebuilt)
