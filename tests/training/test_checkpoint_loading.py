"""--load refuses a damaged or mismatched checkpoint with a message that names the file or the flag.

One 2-process run (DP=2, ZeRO-1) saves at iteration 2; each test damages a copy of it, or resumes
under another layout: another TP size is refused before anything is read into the model (DeepSpeed
would re-split the weights and fail later), a missing layer file, a missing model-states file or a
truncated optimizer shard is named; another data-parallel size needs --no-load-optim, as DeepSpeed
cannot repartition ZeRO's optimizer states.
"""
import shutil

import pytest

from tests.training.pretrain_helpers import preprocessed_corpus, run_pretrain, tiny_run_args, training_lines  # noqa: F401

FLAGS = ["--global-batch-size", "4", "--lr-warmup-iters", "1", "--lr-decay-iters", "8", "--eval-iters", "0",
         "--zero-stage", "1"]

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def saved_at_2(preprocessed_corpus, tmp_path_factory):  # noqa: F811
    checkpoint = tmp_path_factory.mktemp("saved") / "ckpt"
    run_pretrain(tiny_run_args(preprocessed_corpus, *FLAGS, "--train-iters", "2", "--save", str(checkpoint),
                                      "--save-interval", "2"), nproc=2)
    return checkpoint


def _resume(corpus, checkpoint, *extra, nproc=2, check=False):
    return run_pretrain(tiny_run_args(corpus, *FLAGS, "--train-iters", "4", "--load", str(checkpoint), *extra),
                        nproc=nproc, check=check)


def _copy(saved, tmp_path):
    return shutil.copytree(saved, tmp_path / "ckpt")


def test_another_tensor_parallel_size_is_refused(preprocessed_corpus, saved_at_2, tmp_path):  # noqa: F811
    result = _resume(preprocessed_corpus, _copy(saved_at_2, tmp_path), "--tensor-model-parallel-size", "2")
    assert result.returncode != 0
    assert ("was saved with --tensor-model-parallel-size 1 and --pipeline-model-parallel-size 1; "
            "this run has 2 and 1") in result.stdout
    assert "successfully loaded checkpoint" not in result.stdout


def test_another_data_parallel_size_needs_no_load_optim_under_zero(preprocessed_corpus, saved_at_2, tmp_path):  # noqa: F811
    checkpoint = _copy(saved_at_2, tmp_path)
    refused = _resume(preprocessed_corpus, checkpoint, nproc=1)
    assert refused.returncode != 0
    assert ("was saved with data-parallel size 2 and ZeRO-partitioned optimizer states; this run has "
            "data-parallel size 1") in refused.stdout
    resumed = _resume(preprocessed_corpus, checkpoint, "--no-load-optim", nproc=1, check=True)
    assert f"successfully loaded checkpoint from {checkpoint} at iteration 2" in resumed.stdout
    assert [(line["iteration"], line["consumed samples"]) for line in training_lines(resumed.stdout)] == [(3, 12), (4, 16)]


@pytest.mark.parametrize("damage, message", [
    ("missing layer", "global_step2 is incomplete: layer_03-model_00-model_states.pt"),
    ("missing model states", "global_step2 holds no mp_rank_*_model_states.pt"),
    ("truncated optimizer shard", "cannot read {checkpoint}/global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
])
def test_a_damaged_checkpoint_is_named(preprocessed_corpus, saved_at_2, tmp_path, damage, message):  # noqa: F811
    checkpoint = _copy(saved_at_2, tmp_path)
    tag = checkpoint / "global_step2"
    if damage == "missing layer":
        (tag / "layer_03-model_00-model_states.pt").unlink()
    elif damage == "missing model states":
        (tag / "mp_rank_00_model_states.pt").unlink()
    else:
        shard = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        shard.write_bytes(shard.read_bytes()[:1000])
    result = _resume(preprocessed_corpus, checkpoint)
    assert result.returncode != 0
    assert message.format(checkpoint=checkpoint) in result.stdout, result.stdout[-3000:]
    assert "pretrain_gpt.py: error: " in result.stdout
