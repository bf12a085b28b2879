"""The runs of test_3d_parallel_cpu.py over 8 gloo processes, and its saving TP=2 x PP=2 x DP=2 (ZeRO-1)
run as a session fixture (``saving_layout_run``, registered in tests/conftest.py): launched once per
session, shared with tests/tools/test_ds_to_universal.py, which converts its global_step2 as its
2_2_2 source. test_3d_parallel_cpu.py's docstring describes the set-up. Likewise the Llama-class
model's saving TP=2 x PP=2 run (``llama_saving_run``), shared by test_llama_layouts.py and the
checkpoint tools' tests.
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


# ---- the Llama-class model (tests/training/test_llama_layouts.py describes the set-up) --------------
LLAMA_MODEL_FLAGS = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
                     "--rotary-base", "500000", "--group-query-attention", "--num-query-groups", "2",
                     "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
LLAMA_NUM_LAYERS, LLAMA_SEQ_LENGTH, LLAMA_GLOBAL_BATCH, LLAMA_TRAIN_ITERS, LLAMA_SAVE_ITERATION = 2, 32, 4, 4, 2
LLAMA_SAVING_LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--sequence-parallel", "--zero-stage", "1"]


def llama_flags(data) -> list[str]:
    """test_layout_equivalence's flags (fp32, dropout 0, CPU initialization, ...) for the Llama-class
    model: 2 layers, hidden 64, 4 heads over 2 key/value groups, SwiGLU (ffn 128), RMSNorm, rotary base
    500000, untied output layer, no biases; sequence 32, global batch 4, 4 iterations."""
    return common_flags(data, seq_length=LLAMA_SEQ_LENGTH, num_layers=LLAMA_NUM_LAYERS,
                        global_batch=LLAMA_GLOBAL_BATCH, train_iters=LLAMA_TRAIN_ITERS) + LLAMA_MODEL_FLAGS


@pytest.fixture(scope="session")
def llama_saving_run(e2e_data, tmp_path_factory) -> dict:
    """train() of the Llama-class model under TP=2 x PP=2 with --sequence-parallel at ZeRO-1, saved
    every LLAMA_SAVE_ITERATION iterations, with "save": its --save directory (a Path). Shared by
    test_llama_layouts.py (its TP=2 x PP=2 layout), test_merge_mp_partitions.py and test_ds_to_universal.py."""
    checkpoints = tmp_path_factory.mktemp("llama_checkpoints")
    flags = llama_flags(e2e_data) + LLAMA_SAVING_LAYOUT + ["--save", str(checkpoints),
                                                           "--save-interval", str(LLAMA_SAVE_ITERATION)]
    run = train(flags, 4, str(tmp_path_factory.mktemp("tb_llama_tp2_pp2")), list(range(1, LLAMA_TRAIN_ITERS + 1)))
    return {**run, "save": checkpoints}
