"""Flags that would waste a run are refused by pretrain_gpt.py itself, before any process group: a run
that does nothing it was asked to, an output directory it could not write, a ds_config key DeepSpeed
does not know, W&B flags without their project. Each case: exit status 2, one ``pretrain_gpt.py:
error:`` line naming the flag and the fix, and nothing written (every output directory of the command
line still absent)."""
import importlib.util
import json
import os
import sys

import pytest

import pretrain_gpt

pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")

MODEL_AND_RUN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                 "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
                 "--lr", "1e-3", "--vocab-file", "vocab.json", "--merge-file", "merges.txt"]


def outputs(tmp_path) -> list[str]:
    """Every output directory flag, each pointing at a directory of ``tmp_path`` that does not exist."""
    return ["--save", str(tmp_path / "ckpt"), "--save-interval", "10", "--tensorboard-dir", str(tmp_path / "tb"),
            "--log-path", str(tmp_path / "logs"), "--data-cache-path", str(tmp_path / "cache")]


def start_error(argv, capsys, monkeypatch) -> str:
    """Run pretrain_gpt.py's main on ``argv`` as a plain one-process launch; return its one error line."""
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as info:
        pretrain_gpt.main(argv)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pretrain_gpt.py: error:")]
    assert info.value.code == 2 and len(errors) == 1, errors
    return errors[0]


RUN_LENGTH_CASES = {
    "eval-only without load": (["--train-iters", "10", "--eval-only"],
                               ["--eval-only", "no --load is given", "random initial weights", "give --load DIR"]),
    "finetune without load": (["--train-iters", "10", "--finetune"],
                              ["--finetune", "no --load is given", "train from scratch", "give --load DIR"]),
    "samples below one batch": (["--train-samples", "3"],
                                ["--train-samples 3", "one global batch (4 samples)", "nothing would be trained",
                                 "give at least 4"]),
    "samples below the rampup's first batch": (
        ["--train-samples", "1", "--rampup-batch-size", "2", "2", "8"],
        ["--train-samples 1", "one global batch (2 samples)", "give at least 2"]),
    "tokens below one batch": (["--train-iters", "10", "--train-tokens", "10"],
                               ["--train-tokens 10", "4 samples x 32 tokens = 128",
                                "stop after the first iteration", "give at least 128"]),
}


@pytest.mark.parametrize("case", sorted(RUN_LENGTH_CASES))
def test_a_run_that_would_do_nothing_asked_is_refused(case, tmp_path, capsys, monkeypatch):
    extra, words = RUN_LENGTH_CASES[case]
    message = start_error(MODEL_AND_RUN + ["--data-path", str(tmp_path / "corpus")] + outputs(tmp_path) + extra,
                          capsys, monkeypatch)
    for word in words:
        assert word in message, f"{word!r} missing from {message!r}"
    assert os.listdir(tmp_path) == []


def test_one_global_batch_of_samples_and_tokens_is_accepted():
    from megatron.training.arguments import parse_args
    argv = MODEL_AND_RUN + ["--data-path", "/data/corpus", "--train-samples", "4", "--train-tokens", "128"]
    assert parse_args(argv, env={}, cuda_available=False).flags.train_tokens == 128


@pytest.mark.parametrize("dest", ["save", "tensorboard_dir", "log_path", "data_cache_path", "wandb_save_dir"])
@pytest.mark.parametrize("where", ["under a file", "a file"])
def test_an_output_directory_that_cannot_be_written_is_named(dest, where, tmp_path, capsys, monkeypatch):
    if dest == "wandb_save_dir":
        pytest.importorskip("wandb", reason="--wandb-project needs wandb (the 'wandb' extra)")
    blocker = tmp_path / "taken"
    blocker.write_text("a file where a directory was meant to be")
    path = str(blocker / "run") if where == "under a file" else str(blocker)
    option = "--" + dest.replace("_", "-")
    argv = MODEL_AND_RUN + ["--data-path", str(tmp_path / "corpus"), "--train-iters", "10"] + outputs(tmp_path)
    argv += [option, path] + (["--wandb-project", "p"] if dest == "wandb_save_dir" else [])
    message = start_error(argv, capsys, monkeypatch)
    assert f"{option} {path}: {blocker} is a file, not a directory" in message
    assert "choose a directory this job can write" in message
    assert os.listdir(tmp_path) == ["taken"] and blocker.read_text().startswith("a file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_is_named(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    argv = MODEL_AND_RUN + ["--data-path", str(tmp_path / "corpus"), "--train-iters", "10",
                            "--tensorboard-dir", str(locked / "tb")]
    message = start_error(argv, capsys, monkeypatch)
    assert f"--tensorboard-dir {locked / 'tb'}: cannot write in {locked}: Permission denied" in message
    assert os.listdir(locked) == []


@pytest.mark.parametrize("config, words", [
    ({"train_batch_sizee": 8, "gradient_clippping": 0.5},
     ["unknown keys train_batch_sizee (did you mean train_batch_size?), gradient_clippping (did you mean "
      "gradient_clipping?)"]),
    ({"zero_optimization": {"stage": 1, "overlap_comn": True}},
     ["unknown key zero_optimization.overlap_comn (did you mean overlap_comm?)"]),
])
def test_a_ds_config_key_deepspeed_does_not_know_is_named(config, words, tmp_path, capsys, monkeypatch):
    ds_config = tmp_path / "ds_config.json"
    ds_config.write_text(json.dumps(config))
    argv = MODEL_AND_RUN + ["--data-path", str(tmp_path / "corpus"), "--train-iters", "10", "--deepspeed",
                            "--deepspeed_config", str(ds_config)] + outputs(tmp_path)
    message = start_error(argv, capsys, monkeypatch)
    assert all(word in message for word in words) and f"in {ds_config}: DeepSpeed" in message, message
    assert os.listdir(tmp_path) == ["ds_config.json"] and json.loads(ds_config.read_text()) == config


@pytest.mark.parametrize("extra, words", [
    (["--wandb-exp-name", "run1"], ["--wandb-exp-name takes effect only with --wandb-project"]),
    (["--wandb-exp-name", "run1", "--wandb-save-dir", "/w"],
     ["--wandb-exp-name, --wandb-save-dir take effect only with --wandb-project"]),
])
def test_wandb_flags_need_the_project(extra, words, tmp_path, capsys, monkeypatch):
    argv = MODEL_AND_RUN + ["--data-path", str(tmp_path / "corpus"), "--train-iters", "10"] + outputs(tmp_path)
    message = start_error(argv + extra, capsys, monkeypatch)
    assert all(word in message for word in words), message
    assert os.listdir(tmp_path) == []


def test_wandb_project_needs_a_directory(tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb", reason="--wandb-project needs wandb (the 'wandb' extra)")
    argv = MODEL_AND_RUN + ["--data-path", str(tmp_path / "corpus"), "--train-iters", "10", "--wandb-project", "p"]
    message = start_error(argv, capsys, monkeypatch)
    assert "--wandb-project needs a directory for the run files: give --wandb-save-dir, or --save" in message
    assert os.listdir(tmp_path) == []


def test_wandb_project_needs_wandb_installed(tmp_path, capsys, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "wandb" else
                        find_spec(name, *rest))
    argv = MODEL_AND_RUN + ["--data-path", str(tmp_path / "corpus"), "--train-iters", "10", "--wandb-project", "p",
                            "--wandb-save-dir", str(tmp_path / "wandb")]
    message = start_error(argv, capsys, monkeypatch)
    assert "--wandb-project needs the wandb package, which is not installed: pip install wandb" in message
    assert os.listdir(tmp_path) == []
