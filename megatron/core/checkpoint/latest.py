"""The pointer files of a --save directory: which checkpoint a run resumes from.

    latest                               "global_stepN": the tag directory (DeepSpeed's name; its
                                         engine.load_checkpoint reads it)
    latest_checkpointed_iteration.txt    "N": Megatron's tracker
    latest_universal                     the universal checkpoint's directory (ds_to_universal)

``write_latest`` points both ``latest`` and the tracker at iteration N, each replaced atomically
and durably, then syncs the directory; ``write_tracker`` writes the tracker alone (Megatron-LM's
layout) and ``write_universal_latest`` the universal pointer. ``read_latest`` returns the tag a
pointer holds, None when there is no pointer, and refuses, naming the file, one that is not a
file, unreadable, empty, binary, several lines or longer than MAX_BYTES.
"""
import os

from megatron.core.checkpoint.manifest import fsync_path
from megatron.core.checkpoint.output import write_pointer

LATEST = "latest"
TRACKER = "latest_checkpointed_iteration.txt"
UNIVERSAL_LATEST = "latest_universal"
MAX_BYTES = 4096


class LatestError(ValueError):
    """A pointer file that cannot be read; the message names it and the fix."""


def checkpoint_tag(iteration: int) -> str:
    return f"global_step{iteration}"


def read_latest(directory: str, name: str = LATEST) -> str | None:
    """The tag the pointer ``name`` of ``directory`` holds; None when it does not exist (module docstring)."""
    path = os.path.join(directory, name)
    if not os.path.lexists(path):
        return None
    if not os.path.isfile(path):
        raise LatestError(f"{path} is not a file: it must hold the tag to resume from, e.g. global_step1000")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as error:
        raise LatestError(f"cannot read {path} ({error.strerror})") from None
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = None
    if not tag or len(raw) > MAX_BYTES or "\x00" in tag or "\n" in tag:
        shown = "empty" if not raw.strip() else f"not a tag name ({raw[:40]!r})"
        raise LatestError(f"{path} is {shown}: it must hold the tag to resume from, e.g. global_step1000; "
                          f"write one of the global_stepN directories there")
    return tag


def write_latest(directory: str, iteration: int) -> None:
    """Point ``latest`` and the tracker of ``directory`` at ``iteration`` (module docstring)."""
    write_pointer(os.path.join(directory, LATEST), checkpoint_tag(iteration))
    write_pointer(os.path.join(directory, TRACKER), f"{iteration}\n")
    fsync_path(directory)


def write_tracker(directory: str, iteration: str) -> None:
    """Megatron-LM's tracker alone (its own layout has no ``latest``): "N" or "release"."""
    write_pointer(os.path.join(directory, TRACKER), iteration)


def write_universal_latest(directory: str, tag: str) -> None:
    """Point ``latest_universal`` of ``directory`` at the universal checkpoint ``tag`` inside it."""
    write_pointer(os.path.join(directory, UNIVERSAL_LATEST), tag)
