"""output.py: a conversion's output exists whole or not at all, and a write the filesystem refuses is
an OutputError naming the output, the cause and the file (faults injected by tests/disk_faults.py)."""
import errno
import os

import pytest
import torch

from megatron.core.checkpoint.output import (OutputError, output_errors, save_torch_file, staged_directory,
                                             write_pointer)
from tests.disk_faults import full_disk, read_only


def test_a_full_disk_mid_file_names_the_file_and_leaves_no_output(tmp_path, monkeypatch):
    output = str(tmp_path / "out")
    full_disk(monkeypatch, tmp_path, capacity=10_000)
    with pytest.raises(OutputError) as error:
        with staged_directory(output) as staging:
            os.makedirs(os.path.join(staging, "global_step2"))
            save_torch_file({"weight": torch.zeros(100_000)}, os.path.join(staging, "global_step2", "layer_01.pt"))
    assert str(error.value) == (f"cannot write --output_folder {output}: No space left on device (ENOSPC) "
                                f"({output}/global_step2/layer_01.pt)")
    assert os.listdir(tmp_path) == []


def test_a_read_only_parent_is_named(tmp_path, monkeypatch):
    output = str(tmp_path / "ro" / "new" / "out")
    (tmp_path / "ro").mkdir()
    read_only(monkeypatch, tmp_path / "ro")
    with pytest.raises(OutputError, match=rf"cannot write --save {output}: Read-only file system \(EROFS\) "
                                          rf"\({tmp_path}/ro/new\)"):
        with staged_directory(output, "--save"):
            pass


def test_a_file_in_the_way_is_named(tmp_path):
    (tmp_path / "notes.txt").write_text("")
    output = str(tmp_path / "notes.txt" / "out")
    with pytest.raises(OutputError, match=f"cannot write --output_folder {output}: {tmp_path}/notes.txt is a file"):
        with staged_directory(output):
            pass


def test_errors_of_other_paths_pass_through(tmp_path):
    """A failed read of the input is not the output's fault: it keeps its own error."""
    with pytest.raises(FileNotFoundError):
        with output_errors(str(tmp_path / "out" / "x"), "--output_folder"):
            open(tmp_path / "input" / "global_step2" / "layer.pt").close()


def test_a_refused_pointer_leaves_the_old_one_and_no_temporary(tmp_path, monkeypatch):
    latest = tmp_path / "latest"
    latest.write_text("global_step2")
    full_disk(monkeypatch, tmp_path, capacity=0)
    with pytest.raises(OSError) as error:
        write_pointer(str(latest), "global_step4")
    assert error.value.errno == errno.ENOSPC and error.value.filename == str(latest)
    monkeypatch.undo()
    assert latest.read_text() == "global_step2" and os.listdir(tmp_path) == ["latest"]
