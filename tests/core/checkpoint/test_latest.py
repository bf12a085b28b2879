"""The pointer files: written together, atomically, read back; a missing one is None, a garbled one
refused naming the file."""
import os

import pytest

from megatron.core.checkpoint import latest
from megatron.core.checkpoint.latest import LatestError, read_latest, write_latest


def test_latest_and_the_tracker_are_written_together_and_read_back(tmp_path):
    assert read_latest(str(tmp_path)) is None
    write_latest(str(tmp_path), 20)
    write_latest(str(tmp_path), 30)
    assert (tmp_path / "latest").read_text() == "global_step30"
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "30\n"
    assert sorted(os.listdir(tmp_path)) == ["latest", "latest_checkpointed_iteration.txt"]  # no temporary left
    assert read_latest(str(tmp_path)) == "global_step30"


def test_the_universal_pointer_and_megatron_lm_tracker(tmp_path):
    latest.write_universal_latest(str(tmp_path), "global_step30_universal")
    latest.write_tracker(str(tmp_path), "release")
    assert read_latest(str(tmp_path), latest.UNIVERSAL_LATEST) == "global_step30_universal"
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert read_latest(str(tmp_path)) is None


@pytest.mark.parametrize("content,shown", [
    (b"", "is empty"), (b" \n", "is empty"), (b"\xff\xfe", "is not a tag name"), (b"global_step3\x00", "is not a tag name"),
    (b"global_step3\nglobal_step4", "is not a tag name"), (b"g" * 5000, "is not a tag name")])
def test_a_garbled_pointer_is_refused_naming_the_file(tmp_path, content, shown):
    (tmp_path / "latest").write_bytes(content)
    with pytest.raises(LatestError, match=f"{tmp_path}/latest {shown}"):
        read_latest(str(tmp_path))
    assert (tmp_path / "latest").read_bytes() == content


def test_a_pointer_that_is_a_directory_is_refused(tmp_path):
    (tmp_path / "latest").mkdir()
    with pytest.raises(LatestError, match=f"{tmp_path}/latest is not a file"):
        read_latest(str(tmp_path))

