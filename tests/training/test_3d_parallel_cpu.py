"""3D parallelism over 8 gloo processes: TP=2 x PP=2 x DP=2 (ZeRO-1), TP=4 x PP=2 and TP=2 x PP=4 train
the same model as one process, iteration by iteration; a checkpoint saved under TP=2 x PP=2 x DP=2
resumes under that layout where it stood.

Set-up shared by the runs (as test_layout_equivalence.py, scaled so every layout divides the model):
CPU, gloo, fp32, dropout 0, --use-cpu-initialization, the vocabulary padded to 1152 (tokenizer 1000)
whatever the TP degree, 4 layers (PP=4: one per stage; PP=2: two), 4 heads (TP=4: one per rank),
hidden 64, sequence 32, micro batch 1, global batch 8 (4 micro batches per data-parallel rank at
DP=2, 8 at DP=1), 6 iterations with a warmup step at lr 0 then a cosine decay, weight decay 1.0 and
clipping at 1.0, which iterations 1-4 trigger (gradient norms ~2.1 down to ~1.25): gradient
reduction over TP, DP and the pipeline's tied embedding, clipping and the optimizer step are all in
the losses from iteration 2 on.

Values are read at full precision from TensorBoard; the tolerances are test_layout_equivalence.py's
(its docstring says why): losses 1e-5 relative, gradient norms 1e-4 relative.

The TP=2 x PP=2 x DP=2 run saves every 2 iterations. Its global_step2 is copied into a fresh
directory whose ``latest`` names it, and a fifth launch resumes from there: it must report iteration
2 loaded, then log iterations 3-6 with the uninterrupted run's consumed samples/tokens and learning
rates, and the same losses and gradient norms. That saving run is a session fixture
(parallel_3d_runs.saving_layout_run): tests/tools/test_ds_to_universal.py converts its global_step2
as its 2_2_2 source, so its sizes are this module's.

Five launches (one single process, four of 8 processes, ~25 s each): about 2 minutes on 2 cores.
"""
import glob
import os
import shutil

import pytest
import torch

from tests.training.parallel_3d_runs import (GLOBAL_BATCH, LAYOUTS, PROCESSES, SAVE_ITERATION, SAVING_LAYOUT,
                                             SEQ_LENGTH, TRAIN_ITERS, shared_flags, train)
from tests.training.test_layout_equivalence import GRAD_NORM_RTOL, LOSS_RTOL, assert_counters_of_every_iteration

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def runs(e2e_data, saving_layout_run, tmp_path_factory):
    """name -> train() of the single-process run and of each 8-process layout; "checkpoints": the
    saving layout's --save directory."""
    steps = list(range(1, TRAIN_ITERS + 1))
    found = {"single": train(shared_flags(e2e_data), 1, str(tmp_path_factory.mktemp("tb_single")), steps)}
    for name, flags in LAYOUTS.items():
        if name == SAVING_LAYOUT:
            found[name] = saving_layout_run
        else:
            found[name] = train(shared_flags(e2e_data) + flags + ["--zero-stage", "1"], PROCESSES,
                                str(tmp_path_factory.mktemp(f"tb_{name}")), steps)
    found["checkpoints"] = found[SAVING_LAYOUT]["save"]
    return found


@pytest.fixture(scope="module")
def resumed(runs, e2e_data, tmp_path_factory):
    """The saving layout resumed from its iteration-3 checkpoint, alone in a fresh --load directory."""
    resume_dir = tmp_path_factory.mktemp("resume")
    tag = f"global_step{SAVE_ITERATION}"
    shutil.copytree(runs["checkpoints"] / tag, resume_dir / tag)
    (resume_dir / "latest").write_text(tag)
    flags = shared_flags(e2e_data) + LAYOUTS[SAVING_LAYOUT] + ["--zero-stage", "1", "--load", str(resume_dir)]
    run = train(flags, PROCESSES, str(tmp_path_factory.mktemp("tb_resumed")),
                list(range(SAVE_ITERATION + 1, TRAIN_ITERS + 1)))
    run["load_dir"] = resume_dir
    return run


def test_each_layout_logs_every_iteration_with_the_same_counters(runs):
    for name in ["single", *LAYOUTS]:
        assert_counters_of_every_iteration(runs[name]["lines"], name, TRAIN_ITERS, GLOBAL_BATCH, SEQ_LENGTH)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_the_single_process_run(runs, name):
    run, single = runs[name], runs["single"]
    assert run["loss"] == pytest.approx(single["loss"], rel=LOSS_RTOL)
    assert run["grad_norm"] == pytest.approx(single["grad_norm"], rel=GRAD_NORM_RTOL)
    assert run["lr"] == pytest.approx(single["lr"], rel=1e-6)
    assert [line.number("lm loss") for line in run["lines"]] == pytest.approx(single["loss"], rel=LOSS_RTOL)


def test_the_run_changes_the_loss(runs):
    """Guard against a vacuous comparison: the model learns, and clipping at 1.0 acts."""
    assert len(set(round(loss, 4) for loss in runs["single"]["loss"])) == TRAIN_ITERS
    assert max(runs["single"]["grad_norm"]) > 1.0


def test_checkpoint_holds_the_saved_position(runs):
    checkpoint = runs["checkpoints"] / f"global_step{SAVE_ITERATION}"
    model_state_files = sorted(glob.glob(str(checkpoint / "mp_rank_*_model_states.pt")))
    assert len(model_state_files) == 2 * 2  # one per (TP, PP) rank of the model-parallel grid
    state = torch.load(model_state_files[0], weights_only=False)
    assert state["iteration"] == SAVE_ITERATION
    assert state["consumed_train_samples"] == GLOBAL_BATCH * SAVE_ITERATION
    assert state["consumed_train_tokens"] == GLOBAL_BATCH * SEQ_LENGTH * SAVE_ITERATION
    assert state["args"]["data_parallel_size"] == 2
    assert os.path.isfile(checkpoint / "layer_01-model_00-model_states.pt")  # the pipeline engine's layer files


def test_pipeline_engine_checkpoint_leaves_no_zero_to_fp32(runs):
    """DeepSpeed copies zero_to_fp32.py / zero_to_torch.py beside every checkpoint with ZeRO optimizer
    files, as this ZeRO-1 one has; they cannot read the pipeline engine's checkpoints, so the trainer
    removes them (test_zero_offload.py: they stay beside the plain engine's ZeRO-2 checkpoints)."""
    checkpoint = runs["checkpoints"]
    assert glob.glob(str(checkpoint / f"global_step{SAVE_ITERATION}" / "zero_pp_rank_*_optim_states.pt"))
    assert not (checkpoint / "zero_to_fp32.py").exists() and not (checkpoint / "zero_to_torch.py").exists()


def test_resumed_run_continues_counters_lr_and_losses(runs, resumed):
    assert f"successfully loaded checkpoint from {resumed['load_dir']} at iteration {SAVE_ITERATION}" \
        in resumed["output"]
    reference = {line.iteration: line for line in runs[SAVING_LAYOUT]["lines"]}
    continued = resumed["lines"]
    assert [line.iteration for line in continued] == list(range(SAVE_ITERATION + 1, TRAIN_ITERS + 1))
    for line in continued:
        expected = reference[line.iteration]
        for key in ("consumed samples", "consumed tokens", "learning rate", "global batch size"):
            assert line.fields[key] == expected.fields[key], (line.iteration, key)
    uninterrupted = {key: runs[SAVING_LAYOUT][key][SAVE_ITERATION:] for key in ("loss", "grad_norm", "lr")}
    assert resumed["lr"] == uninterrupted["lr"]
    assert resumed["loss"] == pytest.approx(uninterrupted["loss"], rel=LOSS_RTOL)
    assert resumed["grad_norm"] == pytest.approx(uninterrupted["grad_norm"], rel=GRAD_NORM_RTOL)
