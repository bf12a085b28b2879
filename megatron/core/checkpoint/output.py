"""Writing a converted checkpoint so that it exists whole or not at all.

A conversion writes into a hidden sibling of its output (``.NAME.partial``), describes every file
in a manifest (size and CRC-32, manifest.py), renames the directory into place, and only then
points the ``latest``-style file of the root at it. A conversion that fails or is interrupted
leaves no directory under the output's name; its partial directory is removed when the failure is
an exception.
"""
import contextlib
import os
import shutil

from megatron.core.checkpoint.manifest import MANIFEST_NAME, describe_file, fsync_path, write_manifest


class OutputExistsError(FileExistsError):
    """The output directory is already there; a conversion never writes over it."""


@contextlib.contextmanager
def staged_directory(output: str, flag: str = "--output_folder"):
    """Yield a fresh hidden directory beside ``output``; renamed to ``output`` when the block ends
    without an exception, removed when it raises."""
    output = os.path.normpath(output)
    if os.path.exists(output):
        raise OutputExistsError(f"{flag} {output} already exists: remove it or choose another")
    parent = os.path.dirname(output) or "."
    os.makedirs(parent, exist_ok=True)
    partial = os.path.join(parent, f".{os.path.basename(output)}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # what an interrupted conversion left
    os.makedirs(partial)
    try:
        yield partial
        os.replace(partial, output)
        fsync_path(parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def write_tree_manifest(directory: str, iteration: int) -> int:
    """manifest.json for every file under ``directory`` (relative paths); returns the file count."""
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            if name != MANIFEST_NAME:
                files[os.path.relpath(path, directory)] = describe_file(path)
    write_manifest(directory, iteration, files)
    return len(files)


def write_pointer(path: str, text: str) -> None:
    """Replace the small file ``path`` (``latest``, ``latest_universal``) with ``text``, atomically and durably."""
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    fsync_path(os.path.dirname(path) or ".")


def tree_size(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(directory) for name in names)
