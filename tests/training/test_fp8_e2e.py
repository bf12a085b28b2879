"""pretrain_gpt.py in FP8 (the CPU emulation, --fp8-cpu-emulation): each recipe trains close to the run
without FP8 and not equal to it, in fp32 and in bf16, and so does DP = 2 under ZeRO-3; TP = 2 with
sequence parallelism (also with --tp-comm-overlap) trains what TP = 1 does, and so do DP = 2 under ZeRO-2 (the plain engine) with
full recompute (tensorwise) and PP = 2 with selective recompute; a delayed-scaling run saved and
resumed (also at ZeRO-3) continues the uninterrupted one exactly, and one evaluated after every step
trains as one never evaluated; an FP8 checkpoint loads into a run without FP8 with a notice.

Set-up: test_layout_equivalence's flags (fp32, dropout 0, CPU initialization, clipping at 1.0), 2 layers,
4 iterations of 4 micro-batches, hybrid format. Tolerances: FP8 moves the losses by about 1e-5..1e-4
relative here (2e-3 bounds it). TP = 2 quantizes with the scales of the whole tensors (amaxes reduced
over the group), so its first step's loss and gradient norm equal TP = 1's to fp32 rounding (1e-5);
from then on the weights differ in the last fp32 bits (the row-parallel sums, or DP's gradient sums,
add in another order), and a value that lands on the other side of an FP8 rounding boundary moves by
up to 1/16 of itself, which Adam (normalizing each gradient) turns into whole-step differences of
single weights: the later losses agree to 1e-3. DP = 2 with ZeRO-2 runs tensorwise: DeepSpeed divides
the loss by the micro-batches per rank, so the gradients under DP differ by a power of 2, which each
micro-batch's own scale absorbs exactly.
"""
import glob
import os

import pytest
import torch

from tests.training.e2e_utils import read_scalars, run_pretrain
from tests.training.parallel_3d_runs import GRAD_NORM_TAG, LOSS_TAG
from tests.training.test_layout_equivalence import common_flags, series

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

TRAIN_ITERS, SAVE_ITERATION = 4, 2
STEPS = list(range(1, TRAIN_ITERS + 1))
FP8_RTOL, TP_FIRST_STEP_RTOL, TP_LATER_RTOL = 2e-3, 1e-5, 1e-3
EMULATED = ["--fp8-format", "hybrid", "--fp8-cpu-emulation"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
BF16 = ["--bf16"]
# name -> (processes, flags)
RUNS = {
    "fp32": (1, []),
    "delayed": (1, EMULATED + ["--fp8-recipe", "delayed"]),
    "tensorwise": (1, EMULATED + ["--fp8-recipe", "tensorwise"]),
    "rowwise": (1, EMULATED + ["--fp8-recipe", "rowwise"]),
    "delayed-tp2": (2, EMULATED + TP2_SP),
    "delayed-tp2-overlap": (2, EMULATED + TP2_SP + ["--tp-comm-overlap"]),
    "delayed-dp2-zero3": (2, EMULATED + ["--zero-stage", "3"]),
    "delayed-pp2-selective": (2, EMULATED + ["--pipeline-model-parallel-size", "2", "--recompute-activations"]),
    "tensorwise-dp2-zero2-full": (2, EMULATED + ["--fp8-recipe", "tensorwise", "--zero-stage", "2",
                                                 "--checkpoint-activations"]),
    "bf16": (1, BF16),
    "bf16-delayed": (1, BF16 + EMULATED),
}


def launch(flags: list[str], nproc: int, tensorboard_dir: str) -> dict:
    result = run_pretrain(flags + ["--tensorboard-dir", tensorboard_dir], nproc=nproc, timeout=600)
    result.assert_ok()
    scalars = read_scalars(tensorboard_dir)
    steps = sorted({step for step, _ in scalars[LOSS_TAG]})
    return {"loss": series(scalars, LOSS_TAG, steps), "grad_norm": series(scalars, GRAD_NORM_TAG, steps),
            "steps": steps, "lines": result.log_lines(), "output": result.output, "scalars": scalars}


@pytest.fixture(scope="module")
def runs(e2e_data, tmp_path_factory) -> dict:
    flags = common_flags(e2e_data, train_iters=TRAIN_ITERS)
    return {name: launch(flags + extra, processes, str(tmp_path_factory.mktemp(f"tb_fp8_{name}")))
            for name, (processes, extra) in RUNS.items()}


@pytest.mark.parametrize("name, baseline", [("delayed", "fp32"), ("tensorwise", "fp32"), ("rowwise", "fp32"),
                                            ("bf16-delayed", "bf16"), ("delayed-dp2-zero3", "fp32")])
def test_fp8_trains_close_to_the_run_without_it(runs, name, baseline):
    fp8, plain = runs[name]["loss"], runs[baseline]["loss"]
    assert runs[name]["steps"] == STEPS
    assert fp8 == pytest.approx(plain, rel=FP8_RTOL)
    assert max(abs(a - b) for a, b in zip(fp8, plain)) > 1e-6  # FP8 really ran


@pytest.mark.parametrize("name, one_process", [("delayed-tp2", "delayed"), ("delayed-tp2-overlap", "delayed"),
                                               ("tensorwise-dp2-zero2-full", "tensorwise")])
def test_tp2_with_sequence_parallelism_and_dp2_train_what_one_process_does(runs, name, one_process):
    one, layout = runs[one_process], runs[name]
    assert layout["loss"][0] == pytest.approx(one["loss"][0], rel=TP_FIRST_STEP_RTOL)
    assert layout["grad_norm"][0] == pytest.approx(one["grad_norm"][0], rel=TP_FIRST_STEP_RTOL)
    assert layout["loss"] == pytest.approx(one["loss"], rel=TP_LATER_RTOL)


def test_pipeline_stages_and_recompute_change_nothing(runs):
    """PP = 2 splits the layers, not their sums; recompute reuses the step's scales and weight copies."""
    assert runs["delayed-pp2-selective"]["loss"] == pytest.approx(runs["delayed"]["loss"], rel=1e-6)
    assert runs["delayed-pp2-selective"]["grad_norm"] == pytest.approx(runs["delayed"]["grad_norm"], rel=1e-6)


def test_log_line_and_tensorboard_report_the_recipe_and_delayed_scalings_counts(runs):
    delayed = runs["delayed"]["lines"][-1].fields
    assert delayed["quantization"] == "FP8 hybrid delayed"
    counts = [(line.integer("amax overflows"), line.integer("amax underflows")) for line in runs["delayed"]["lines"]]
    scalars = runs["delayed"]["scalars"]
    assert [value for _, value in scalars["fp8/amax-overflows"]] == [overflows for overflows, _ in counts]
    assert [value for _, value in scalars["fp8/amax-underflows"]] == [underflows for _, underflows in counts]
    assert sum(overflows for overflows, _ in counts) > 0  # history length 1: a growing amax saturates its scale
    tensorwise = runs["tensorwise"]["lines"][-1].fields
    assert tensorwise["quantization"] == "FP8 hybrid tensorwise" and "amax overflows" not in tensorwise
    assert "fp8/amax-overflows" not in runs["tensorwise"]["scalars"]
    assert "quantization" not in runs["fp32"]["lines"][-1].fields


def _layer_states(checkpoint: str) -> list[dict]:
    files = sorted(glob.glob(os.path.join(checkpoint, f"global_step{SAVE_ITERATION}", "layer_*-model_states.pt")))
    return [torch.load(path, map_location="cpu", weights_only=False) for path in files]


def test_saved_and_resumed_delayed_scaling_at_zero3_continues_exactly(runs, e2e_data, tmp_path):
    """ZeRO-3 gathers the whole module into its mp_rank file, the FP8 buffers with it."""
    checkpoint = str(tmp_path / "checkpoint")
    processes, extra = RUNS["delayed-dp2-zero3"]
    flags = common_flags(e2e_data, train_iters=TRAIN_ITERS) + extra
    launch(flags + ["--train-iters", str(SAVE_ITERATION), "--save", checkpoint, "--save-interval",
                    str(SAVE_ITERATION)], processes, str(tmp_path / "tb_saved"))
    resumed = launch(flags + ["--load", checkpoint], processes, str(tmp_path / "tb_resumed"))
    assert resumed["loss"] == runs["delayed-dp2-zero3"]["loss"][SAVE_ITERATION:]
    assert resumed["grad_norm"] == runs["delayed-dp2-zero3"]["grad_norm"][SAVE_ITERATION:]


def test_saved_and_resumed_delayed_scaling_continues_exactly(runs, e2e_data, tmp_path):
    checkpoint = str(tmp_path / "checkpoint")
    flags = common_flags(e2e_data, train_iters=TRAIN_ITERS) + RUNS["delayed"][1]
    launch(flags + ["--train-iters", str(SAVE_ITERATION), "--save", checkpoint, "--save-interval",
                    str(SAVE_ITERATION)], 1, str(tmp_path / "tb_saved"))
    scales = [state[key] for state in _layer_states(checkpoint) for key in state
              if key.endswith("fp8_gemms.delayed.scale")]
    assert len(scales) == 2 * 4 and all(not torch.equal(scale, torch.ones(3)) for scale in scales)
    resumed = launch(flags + ["--load", checkpoint], 1, str(tmp_path / "tb_resumed"))
    assert resumed["steps"] == STEPS[SAVE_ITERATION:]
    assert resumed["loss"] == runs["delayed"]["loss"][SAVE_ITERATION:]
    assert resumed["grad_norm"] == runs["delayed"]["grad_norm"][SAVE_ITERATION:]
    assert "notice: the checkpoint" not in resumed["output"]

    without_fp8 = launch(common_flags(e2e_data, train_iters=TRAIN_ITERS) + ["--load", checkpoint], 1,
                         str(tmp_path / "tb_without"))
    assert "notice: the checkpoint's FP8 delayed-scaling state (amax histories, scales) is dropped: this run has " \
           "no FP8" in without_fp8["output"]
    assert without_fp8["steps"] == STEPS[SAVE_ITERATION:]


def test_evaluation_changes_no_training_step_of_delayed_scaling(e2e_data, tmp_path):
    """Evaluation forwards quantize the weights and record amaxes; the training steps after them must
    not see either (fp8_steps.keep_delayed_amaxes)."""
    flags = common_flags(e2e_data, train_iters=3) + RUNS["delayed"][1] + ["--split", "80,10,10"]
    without = launch(flags, 1, str(tmp_path / "tb_without_eval"))
    evaluated = launch(flags + ["--eval-iters", "2", "--eval-interval", "1"], 1, str(tmp_path / "tb_eval"))
    assert "validation loss at iteration 1" in evaluated["output"]
    assert evaluated["loss"] == without["loss"] and evaluated["grad_norm"] == without["grad_norm"]
