"""tools/build_dataset_indices.py: builds the trainer's index caches ahead of a run, rejects bad flags."""
import glob
import os

import pytest

from tests.disk_faults import full_disk
from tools.build_dataset_indices import main

RUN_FLAGS = ["--seq-length", "64", "--seed", "1234", "--global-batch-size", "4",
             "--eval-interval", "10", "--eval-iters", "2"]


def cache_files(cache_dir, pattern="*.npy"):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(cache_dir, pattern)))


def test_option1_builds_the_trainers_caches_once(e2e_data, tmp_path, capsys):
    cache = str(tmp_path / "cache")
    argv = ["--data-path", e2e_data.data_prefix, "--split", "969,30,1", "--data-cache-path", cache,
            "--train-iters", "30", *RUN_FLAGS]
    main(argv)
    out = capsys.readouterr().out
    # train 30 x 4 = 120; valid (30 // 10 + 1) x 2 x 4 = 32; test 2 x 4 = 8 (the trainer's formulas)
    assert "requested train/valid/test samples: 120 / 32 / 8" in out
    names = cache_files(cache)
    for split, samples in (("train", 120), ("valid", 32), ("test", 8)):
        built = [n for n in names if f"_{split}_indexmap_{samples}ns_64sl_1234s_" in n]
        assert sorted(n.rsplit("_", 2)[-2] for n in built) == ["doc", "sample", "shuffle"], names
    mtimes = {n: os.stat(os.path.join(cache, n)).st_mtime_ns for n in names}
    main(argv)
    assert {n: os.stat(os.path.join(cache, n)).st_mtime_ns for n in cache_files(cache)} == mtimes


def test_train_samples_and_named_groups_from_a_file(e2e_data, tmp_path, capsys):
    groups = tmp_path / "valid_groups.txt"
    groups.write_text(f'"first: 1 0.9:0.95 {e2e_data.data_prefix}" "second: 1 0.95:1 {e2e_data.data_prefix}"\n')
    main(["--train-weighted-split-paths", f"train: 1 0:0.9 {e2e_data.data_prefix}",
          "--valid-weighted-split-paths-path", str(groups), "--data-cache-path", str(tmp_path / "cache"),
          "--train-samples", "40", *RUN_FLAGS])
    out = capsys.readouterr().out
    # --train-samples 40 at global batch 4 is 10 iterations: valid (10 // 10 + 1) x 2 x 4 = 16
    assert "requested train/valid/test samples: 40 / 16 / 8" in out
    assert " first " in out and " second " in out


@pytest.mark.parametrize("extra, message", [
    (["--train-iters", "3", "--train-samples", "12"], "exactly one of --train-iters and --train-samples"),
    (["--train-iters", "3", "--split", "1,1,1", "--train-weighted-split-paths", "t: 1 0:1 PREFIX"],
     "--split applies to --data-path only"),
    (["--train-iters", "3", "--valid-weighted-split-paths", "v: 1 0:1 PREFIX",
      "--valid-weighted-split-paths-path", "groups.txt"], "not allowed with argument"),
])
def test_conflicting_flags_are_refused_by_name(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*RUN_FLAGS, *extra])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--data-path", "0.5", "a", "b"], "--data-path"),
    (["--train-weighted-split-paths", "train 1 0:1 PREFIX"], "--train-weighted-split-paths"),
    ([], "no data"),
])
def test_bad_data_flags_exit_with_a_message(extra, message):
    with pytest.raises(SystemExit) as exit_info:
        main([*RUN_FLAGS, "--train-iters", "3", *extra])
    assert str(exit_info.value.code).startswith("error: ") and message in str(exit_info.value.code)


def test_a_full_cache_directory_is_one_line_and_leaves_no_cache(e2e_data, tmp_path, monkeypatch):
    """The doc index fits, the sample index does not: neither is left, so no run reads half a cache.
    (np.save writes a 128-byte header through the file object, the array through its descriptor, which
    full_disk does not see: 200 bytes let the first header pass, not the second.)"""
    cache = tmp_path / "cache"
    cache.mkdir()
    full_disk(monkeypatch, cache, capacity=200)
    with pytest.raises(SystemExit) as exit_info:
        main(["--data-path", e2e_data.data_prefix, "--data-cache-path", str(cache), "--train-iters", "30",
              *RUN_FLAGS])
    monkeypatch.undo()
    message = str(exit_info.value.code)
    assert message.startswith(f"error: cannot write the index cache {cache}/") and "No space left on device" in message
    assert "\n" not in message and os.listdir(cache) == []


def test_a_damaged_dataset_is_one_line(e2e_data, tmp_path):
    prefix = tmp_path / "cut_text_document"
    for extension in ("idx", "bin"):
        (tmp_path / f"cut_text_document.{extension}").write_bytes(
            open(f"{e2e_data.data_prefix}.{extension}", "rb").read()[:-10 if extension == "bin" else None])
    with pytest.raises(SystemExit) as exit_info:
        main(["--data-path", str(prefix), "--data-cache-path", str(tmp_path / "cache"), "--train-iters", "3",
              *RUN_FLAGS])
    assert str(exit_info.value.code).startswith(f"error: {prefix}.bin: data file has ")
