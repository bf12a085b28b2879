"""Writing a converted checkpoint so that it exists whole or not at all.

A conversion writes into a hidden sibling of its output (``.NAME.partial``), describes every file
in a manifest (size and CRC-32, manifest.py), renames the directory into place, and only then
points the ``latest``-style file of the root at it. A conversion that fails or is interrupted
leaves no directory under the output's name; its partial directory is removed when the failure is
an exception. A write the filesystem refuses (full, read-only, a path that cannot be created)
becomes an OutputError naming the output, the cause and the file.

Tensors are saved through a Python file (``save_torch_file``): torch's own writer, given a path,
reports a failed write as a RuntimeError without the cause ("basic_ios::clear: iostream error").
"""
import contextlib
import errno
import os
import shutil

import torch

from megatron.core.checkpoint.manifest import MANIFEST_NAME, describe_file, fsync_path, write_manifest


class OutputExistsError(FileExistsError):
    """The output directory is already there; a conversion never writes over it."""


class OutputError(Exception):
    """The output cannot be written (module docstring); one line naming the path and the cause."""


def os_error_cause(error: OSError) -> str:
    """"No space left on device (ENOSPC)": the system's words and the errno's name."""
    name = errno.errorcode.get(error.errno) if error.errno is not None else None
    words = error.strerror or str(error)
    return f"{words} ({name})" if name else words


def _of_output(path: str, parent: str, staging: str | None) -> bool:
    """``path`` is where the output goes: in the staging directory, in the output's parent, or on the
    way to it (a directory to create)."""
    inside = staging is not None and os.path.commonpath([path, staging]) == staging
    return inside or os.path.dirname(path) == parent or os.path.commonpath([path, parent]) == path


@contextlib.contextmanager
def output_errors(output: str, flag: str, staging: str | None = None):
    """Inside the block an OSError about the output's paths (``_of_output``), or about no path (a
    failed write), becomes an OutputError; ``staging``: the hidden directory standing for ``output``."""
    parent = os.path.abspath(os.path.dirname(output) or ".")
    try:
        yield
    except OSError as error:
        path = os.path.abspath(os.fsdecode(error.filename)) if error.filename is not None else None
        if path is not None and not _of_output(path, parent, staging):
            raise
        inside = path is not None and staging is not None and os.path.commonpath([path, staging]) == staging
        shown = os.path.normpath(os.path.join(output, os.path.relpath(path, staging))) if inside else path
        where = f" ({shown})" if shown not in (None, output) else ""
        raise OutputError(f"cannot write {flag} {output}: {os_error_cause(error)}{where}") from None


@contextlib.contextmanager
def staged_directory(output: str, flag: str = "--output_folder"):
    """Yield a fresh hidden directory beside ``output``; renamed to ``output`` when the block ends
    without an exception, removed when it raises (an OSError of the output as an OutputError)."""
    output = os.path.normpath(output)
    if os.path.exists(output):
        raise OutputExistsError(f"{flag} {output} already exists: remove it or choose another")
    parent = os.path.dirname(output) or "."
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise OutputError(f"cannot write {flag} {output}: {parent} is a file, not a directory")
    partial = os.path.abspath(os.path.join(parent, f".{os.path.basename(output)}.partial"))
    with output_errors(output, flag, partial):
        try:
            os.makedirs(parent, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # what an interrupted conversion left
            os.makedirs(partial)
            yield partial
            os.replace(partial, output)
            fsync_path(parent)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise


def refused_write(error: BaseException) -> OSError | None:
    """The OSError behind ``error``: itself, or the one torch's zip writer was handling when it raised
    its own RuntimeError ("unexpected pos ...") on closing the file."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def naming_refused_writes(path: str):
    """Inside the block, a refused write (``refused_write``) is raised as an OSError naming ``path``
    unless it names a file already."""
    try:
        yield
    except (OSError, RuntimeError) as error:
        refused = refused_write(error)
        if refused is None:
            raise
        raise OSError(refused.errno, refused.strerror, refused.filename or path) from None


def save_torch_file(value, path: str) -> None:
    """torch.save of ``value`` into ``path``; a refused write raises the OSError that names the path."""
    with naming_refused_writes(path), open(path, "wb") as f:
        torch.save(value, f)


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
    """Replace the small file ``path`` (``latest``, ``latest_universal``) with ``text``, atomically and
    durably; a failed write leaves ``path`` as it was, and no temporary file."""
    temporary = f"{path}.tmp{os.getpid()}"
    try:
        with open(temporary, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise OSError(error.errno, error.strerror, path) from None
    fsync_path(os.path.dirname(path) or ".")


def tree_size(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(directory) for name in names)
