"""--load refuses a damaged or mismatched checkpoint with a message that names the file or the flag.

One 2-process run (DP=2, ZeRO-1) saves at iterations 1 and 2; each test damages a copy of it, or
resumes under another layout: another TP size is refused before anything is read into the model
(DeepSpeed would re-split the weights and fail later); 19 kinds of damage (missing, truncated,
bit-flipped or foreign files, a broken or deleted manifest, a broken or missing ``latest``, a
``latest`` naming another directory's checkpoint or a save that never finished) are each named
before training starts, and leave the checkpoint as it was; a --load naming a file or a tag
directory is refused rather than started from scratch; --allow-missing-manifest loads a checkpoint
whose manifest was deleted, with a warning; another data-parallel size needs --no-load-optim, as
DeepSpeed cannot repartition ZeRO's optimizer states; a run from iteration 0 refuses a --save that
holds checkpoints.
"""
import shutil

import pytest

from megatron.core.checkpoint.manifest import SAVING_MARKER
from tests.training.pretrain_helpers import run_pretrain, tiny_run_args, training_lines

FLAGS = ["--global-batch-size", "4", "--lr-warmup-iters", "1", "--lr-decay-iters", "8", "--eval-iters", "0",
         "--zero-stage", "1"]

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def saved_at_2(preprocessed_corpus, tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("saved") / "ckpt"
    run_pretrain(tiny_run_args(preprocessed_corpus, *FLAGS, "--train-iters", "2", "--save", str(checkpoint),
                               "--save-interval", "1"), nproc=2)
    return checkpoint


def _resume(corpus, checkpoint, *extra, nproc=2, check=False):
    return run_pretrain(tiny_run_args(corpus, *FLAGS, "--train-iters", "4", "--load", str(checkpoint), *extra),
                        nproc=nproc, check=check)


def _copy(saved, tmp_path):
    return shutil.copytree(saved, tmp_path / "ckpt")


def test_another_tensor_parallel_size_is_refused(preprocessed_corpus, saved_at_2, tmp_path):
    result = _resume(preprocessed_corpus, _copy(saved_at_2, tmp_path), "--tensor-model-parallel-size", "2")
    assert result.returncode != 0
    assert ("was saved with --tensor-model-parallel-size 1 and --pipeline-model-parallel-size 1; "
            "this run has 2 and 1") in result.stdout
    assert "successfully loaded checkpoint" not in result.stdout


def test_another_data_parallel_size_needs_no_load_optim_under_zero(preprocessed_corpus, saved_at_2, tmp_path):
    checkpoint = _copy(saved_at_2, tmp_path)
    refused = _resume(preprocessed_corpus, checkpoint, nproc=1)
    assert refused.returncode != 0
    assert ("was saved with data-parallel size 2 and ZeRO-partitioned optimizer states; this run has "
            "data-parallel size 1") in refused.stdout
    resumed = _resume(preprocessed_corpus, checkpoint, "--no-load-optim", nproc=1, check=True)
    assert f"successfully loaded checkpoint from {checkpoint} at iteration 2" in resumed.stdout
    assert [(line["iteration"], line["consumed samples"]) for line in training_lines(resumed.stdout)] == [(3, 12), (4, 16)]


def flip_a_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[:1000])


SHARD = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
LAYER = "layer_01-model_00-model_states.pt"
# What is done to a copy of the checkpoint (tag = its global_step2), and what the error must say.
DAMAGES = {
    "missing layer file": (lambda ckpt, tag: (tag / "layer_03-model_00-model_states.pt").unlink(),
                           "{tag}/layer_03-model_00-model_states.pt is missing (listed in {tag}/manifest.json)"),
    "missing model states": (lambda ckpt, tag: (tag / "mp_rank_00_model_states.pt").unlink(),
                             "{tag}/mp_rank_00_model_states.pt is missing"),
    "missing optimizer shard": (lambda ckpt, tag: (tag / SHARD).unlink(), "{tag}/" + SHARD + " is missing"),
    "truncated optimizer shard": (lambda ckpt, tag: truncate(tag / SHARD), "{tag}/" + SHARD + " has 1000 bytes"),
    "truncated layer file": (lambda ckpt, tag: truncate(tag / LAYER), "{tag}/" + LAYER + " has 1000 bytes"),
    "bit flip in a layer file": (lambda ckpt, tag: flip_a_bit(tag / LAYER),
                                 "{tag}/" + LAYER + ": CRC-32"),
    "bit flip in an optimizer shard": (lambda ckpt, tag: flip_a_bit(tag / SHARD), "{tag}/" + SHARD + ": CRC-32"),
    "bit flip in the model states": (lambda ckpt, tag: flip_a_bit(tag / "mp_rank_00_model_states.pt"),
                                     "{tag}/mp_rank_00_model_states.pt: CRC-32"),
    "model states of another iteration": (
        lambda ckpt, tag: shutil.copy(ckpt / "global_step1" / "mp_rank_00_model_states.pt", tag),
        "{tag}/mp_rank_00_model_states.pt"),
    "unreadable manifest": (lambda ckpt, tag: (tag / "manifest.json").write_text('{"files": '),
                            "{tag}/manifest.json cannot be read"),
    "empty latest": (lambda ckpt, tag: (ckpt / "latest").write_text(""), "{ckpt}/latest is empty"),
    "binary latest": (lambda ckpt, tag: (ckpt / "latest").write_bytes(b"\x89PNG\r\n\x1a\n"),
                      "{ckpt}/latest is not a tag name"),
    "latest naming a file": (lambda ckpt, tag: (ckpt / "latest").write_text("latest_checkpointed_iteration.txt"),
                             "{ckpt}/latest names {ckpt}/latest_checkpointed_iteration.txt, which is a file"),
    "latest naming nothing": (lambda ckpt, tag: (ckpt / "latest").write_text("global_step9"),
                              "{ckpt}/latest names {ckpt}/global_step9, which is nothing"),
    "deleted latest": (lambda ckpt, tag: (ckpt / "latest").unlink(),
                       "--load {ckpt} holds checkpoints (global_step1, global_step2) but no 'latest' file"),
    "deleted manifest and a bit flip in a layer file": (
        lambda ckpt, tag: ((tag / "manifest.json").unlink(), flip_a_bit(tag / LAYER)),
        "{tag} has no manifest.json, though this trainer wrote it"),
    "latest naming another directory's checkpoint": (
        lambda ckpt, tag: (shutil.copytree(tag, ckpt.parent / "base" / "global_step2"),
                           (ckpt / "latest").write_text("../base/global_step2")),
        "{ckpt}/latest names '../base/global_step2', not a global_stepN directory of --load {ckpt}"),
    "latest naming a save that never finished": (
        lambda ckpt, tag: (shutil.copytree(tag, ckpt / "global_step3"), (ckpt / "global_step3" / SAVING_MARKER).touch(),
                           (ckpt / "latest").write_text("global_step3")),
        "{ckpt}/latest names {ckpt}/global_step3, a save that never finished (saving.incomplete is in it)"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_checkpoint_is_named_before_training(preprocessed_corpus, saved_at_2, tmp_path, damage):
    checkpoint = _copy(saved_at_2, tmp_path)
    tag = checkpoint / "global_step2"
    mutate, message = DAMAGES[damage]
    mutate(checkpoint, tag)
    before = snapshot(checkpoint)
    result = _resume(preprocessed_corpus, checkpoint)
    assert result.returncode != 0
    assert message.format(ckpt=checkpoint, tag=tag) in result.stdout, result.stdout[-3000:]
    assert "pretrain_gpt.py: error: " in result.stdout and "successfully loaded checkpoint" not in result.stdout
    assert not training_lines(result.stdout)
    assert snapshot(checkpoint) == before


def snapshot(directory):
    """Every path under ``directory`` with its modification time: what a refused run must not change."""
    return {path: path.stat().st_mtime_ns for path in directory.rglob("*")}


def test_load_naming_a_file_or_a_tag_directory_is_refused(preprocessed_corpus, saved_at_2, tmp_path):
    checkpoint = _copy(saved_at_2, tmp_path)
    before = snapshot(checkpoint)
    for load, message in [(checkpoint / "latest", f"--load {checkpoint}/latest is a file, not a checkpoint directory"),
                          (checkpoint / "global_step2",
                           f"--load {checkpoint}/global_step2 is a checkpoint's own directory: give the directory "
                           f"that holds it, --load {checkpoint}")]:
        result = _resume(preprocessed_corpus, load, nproc=1)
        assert result.returncode != 0 and message in result.stdout, result.stdout[-3000:]
        assert "starts from scratch" not in result.stdout and not training_lines(result.stdout)
    assert snapshot(checkpoint) == before


def test_a_deleted_manifest_loads_only_with_the_flag_and_a_warning(preprocessed_corpus, saved_at_2, tmp_path):
    checkpoint = _copy(saved_at_2, tmp_path)
    (checkpoint / "global_step2" / "manifest.json").unlink()
    resumed = _resume(preprocessed_corpus, checkpoint, "--allow-missing-manifest", check=True).stdout
    assert (f"WARNING: {checkpoint}/global_step2 has no manifest.json, though this trainer wrote it" in resumed
            and "--allow-missing-manifest: its files are read UNVERIFIED" in resumed)
    assert f"successfully loaded checkpoint from {checkpoint} at iteration 2" in resumed
    assert [line["iteration"] for line in training_lines(resumed)] == [3, 4]


def test_a_fresh_start_never_overwrites_saved_checkpoints(preprocessed_corpus, saved_at_2, tmp_path):
    checkpoint = _copy(saved_at_2, tmp_path)
    before = {path: path.stat().st_mtime_ns for path in checkpoint.rglob("*")}
    for load in ([], ["--load", str(tmp_path / "ckpt-typo")]):
        result = run_pretrain(tiny_run_args(preprocessed_corpus, *FLAGS, "--train-iters", "4", "--save",
                                            str(checkpoint), "--save-interval", "2", *load), nproc=2, check=False)
        assert result.returncode != 0
        assert (f"--save {checkpoint} already holds checkpoints (global_step1, global_step2) and this run starts at "
                f"iteration 0") in result.stdout and "--overwrite-checkpoints" in result.stdout
        assert "> initializing torch distributed" not in result.stdout
    assert {path: path.stat().st_mtime_ns for path in checkpoint.rglob("*")} == before
