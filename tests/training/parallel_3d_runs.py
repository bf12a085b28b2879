"""The runs of test_3d_parallel_cpu.py over 8 gloo processes, and its saving TP=2 x PP=2 x DP=2 (ZeRO-1)
run as a session fixture (``saving_layout_run``, registered in tests/conftest.py): launched once per
session, shared with tests/tools/test_ds_to_universal.py, which converts its global_step2 as its
2_2_2 source. test_3d_parallel_cpu.py's docstring describes the set-up.
"""
import pytest

from tests.training.e2e_utils import read_scalars, run_pretrain
from tests.training.test_layout_equivalence import common_flags, series

# The optimizer and schedule flags are test_layout_equivalence's (common_flags); only the sizes differ.
NUM_LAYERS, SEQ_LENGTH, GLOBAL_BATCH, TRAIN_ITERS, SAVE_ITERATION = 4, 32, 8, 6, 2
PROCESSES = 8
LAUNCH_TIMEOUT = 600
SAVING_LAYOUT = "tp2-pp2-dp2"
# name -> layout flags, each over PROCESSES processes
LAYOUTS = {
    "tp2-pp2-dp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    "tp4-pp2": ["--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2"],
    "tp2-pp4": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4"],
}
LOSS_TAG, GRAD_NORM_TAG, LR_TAG = "lm-loss-training/lm loss", "grad-norm/grad-norm", "learning-rate/learning-rate"


def train(flags: list[str], nproc: int, tensorboard_dir: str, steps: list[int]) -> dict:
    """One pretrain_gpt.py launch -> {"loss", "grad_norm", "lr": per-step values, "lines": log lines, "output",
    "scalars": every TensorBoard scalar}."""
    result = run_pretrain(flags + ["--tensorboard-dir", tensorboard_dir], nproc=nproc, timeout=LAUNCH_TIMEOUT)
    result.assert_ok()
    scalars = read_scalars(tensorboard_dir)
    return {"loss": series(scalars, LOSS_TAG, steps), "grad_norm": series(scalars, GRAD_NORM_TAG, steps),
            "lr": series(scalars, LR_TAG, steps), "lines": result.log_lines(), "output": result.output,
            "scalars": scalars}


def shared_flags(data) -> list[str]:
    """The model, data and schedule flags every run of test_3d_parallel_cpu.py shares."""
    return common_flags(data, seq_length=SEQ_LENGTH, num_layers=NUM_LAYERS, global_batch=GLOBAL_BATCH,
                        train_iters=TRAIN_ITERS)


@pytest.fixture(scope="session")
def saving_layout_run(e2e_data, tmp_path_factory) -> dict:
    """train() of the saving layout, saved every SAVE_ITERATION iterations, with "save": its --save
    directory (a Path)."""
    checkpoints = tmp_path_factory.mktemp("checkpoints")
    flags = shared_flags(e2e_data) + LAYOUTS[SAVING_LAYOUT] + [
        "--zero-stage", "1", "--save", str(checkpoints), "--save-interval", str(SAVE_ITERATION)]
    run = train(flags, PROCESSES, str(tmp_path_factory.mktemp(f"tb_{SAVING_LAYOUT}")),
                list(range(1, TRAIN_ITERS + 1)))
    return {**run, "save": checkpoints}
