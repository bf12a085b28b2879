"""Who wrote a checkpoint, and what its missing manifest means.

This trainer's save and every conversion tool that writes a checkpoint from verified input put
``manifest.json`` (manifest.py) beside its files. A checkpoint of this trainer without one has lost
it (deleted, or not copied along), or was written from unverified input; either way nothing tells
whether its files are still those that were written, so it is refused unless the reader's flag
allows it, and then read with a warning. A checkpoint of another trainer (Megatron-DeepSpeed, which
writes no manifest) is read without checksums after a notice.

Recognition, from a model-states file's state: this trainer's ``args`` entry is a dict of plain
values holding the model configuration under ``model`` (checkpointing.configuration_summary);
Megatron-DeepSpeed pickles its argparse Namespace there. A state translated from another trainer's
checkpoint names that trainer under ``WRITER_KEY`` and stays that trainer's.
"""
from collections.abc import Mapping

from megatron.core.checkpoint.manifest import MANIFEST_NAME

WRITER_KEY = "checkpoint_written_by"


class UnverifiedCheckpointError(ValueError):
    """A checkpoint of this trainer without its manifest, read without the flag that allows it."""


def written_by_this_trainer(state: Mapping) -> bool:
    """``state`` (a model-states file's) was written by this trainer or its tools (module docstring)."""
    arguments = state.get("args")
    return isinstance(arguments, Mapping) and "model" in arguments and state.get(WRITER_KEY) is None


def unverified_reading_line(tag_directory: str, state: Mapping, allowed: bool, allow_flag: str, advice: str) -> str:
    """The line to print before reading ``tag_directory``, which has no manifest: a notice for another
    trainer's checkpoint, a warning for this trainer's when ``allowed``; otherwise raises
    UnverifiedCheckpointError naming ``allow_flag`` after ``advice`` (what else the reader can do)."""
    if not written_by_this_trainer(state):
        writer = state.get(WRITER_KEY) or "another trainer"
        return (f"notice: {tag_directory} was written by {writer} (no {MANIFEST_NAME}): its files are read "
                f"without checksum verification")
    missing = (f"{tag_directory} has no {MANIFEST_NAME}, though this trainer wrote it (its saves and conversion "
               f"tools write one): the manifest was deleted or not copied, or the checkpoint was converted from "
               f"unverified input")
    if not allowed:
        raise UnverifiedCheckpointError(f"{missing}. Nothing can tell whether its files are intact: {advice}, or "
                                        f"add {allow_flag} to read them unverified")
    return f"WARNING: {missing}; {allow_flag}: its files are read UNVERIFIED, a damaged file goes unnoticed"
