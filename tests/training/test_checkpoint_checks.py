"""checkpoint_checks.resume_directory: --load must be a directory that holds checkpoints, and ``latest``
must name a complete global_stepN inside it; each refusal names the file and what to do."""
import re

import pytest

from megatron.core.checkpoint.manifest import SAVING_MARKER
from megatron.training.checkpoint_checks import CheckpointError, checkpoint_tags, resume_directory


@pytest.fixture
def load(tmp_path):
    """A --load directory with global_step2 (complete) and global_step4 (a save that never finished)."""
    directory = tmp_path / "ckpt"
    for tag in ("global_step2", "global_step4"):
        (directory / tag).mkdir(parents=True)
        (directory / tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    (directory / "global_step4" / SAVING_MARKER).write_text("")
    (directory / ".global_step6.starting").mkdir()  # what a kill while marking a save leaves
    (directory / "latest").write_text("global_step2")
    return directory


def test_only_complete_tags_count(load):
    assert checkpoint_tags(str(load)) == ["global_step2"]
    assert resume_directory(str(load)) == str(load / "global_step2")


@pytest.mark.parametrize("latest, message", [
    ("../base/global_step2", "latest names '../base/global_step2', not a global_stepN directory of --load"),
    ("global_step4", "global_step4, a save that never finished (saving.incomplete is in it): point "),
    (".global_step6.starting", "latest names '.global_step6.starting', not a global_stepN directory"),
])
def test_latest_must_name_a_complete_global_step_inside_load(load, latest, message):
    (load.parent / "base" / "global_step2").mkdir(parents=True)
    (load / "latest").write_text(latest)
    with pytest.raises(CheckpointError, match=re.escape(message)) as error:
        resume_directory(str(load))
    assert str(load / "latest") in str(error.value)
    if latest == "global_step4":
        assert str(error.value).endswith("(complete: global_step2)")


def test_load_naming_a_file_or_a_tag_directory_is_refused(load):
    with pytest.raises(CheckpointError, match=f"--load {load}/latest is a file, not a checkpoint directory"):
        resume_directory(str(load / "latest"))
    with pytest.raises(CheckpointError, match=f"--load {load}/global_step2 is a checkpoint's own directory: give "
                                              f"the directory that holds it, --load {load}, .*\\(global_step2\\)"):
        resume_directory(str(load / "global_step2"))


def test_latest_universal_may_name_any_directory_of_load(load):
    (load / "global_step2_universal").mkdir()
    (load / "latest_universal").write_text("global_step2_universal")
    assert resume_directory(str(load), universal=True) == str(load / "global_step2_universal")
    (load / "latest_universal").write_text("../global_step2_universal")
    with pytest.raises(CheckpointError, match="latest_universal names '../global_step2_universal', not a directory"):
        resume_directory(str(load), universal=True)
