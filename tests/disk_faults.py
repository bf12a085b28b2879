"""A directory that refuses writes as a read-only or full filesystem would, for the tests of what a tool
reports and leaves on disk then. The tests run as root here, where permission bits stop nothing, so the
faults are injected: ``builtins.open``, and for a read-only directory ``os.open`` (tempfile's) and
``os.mkdir``, are patched (pytest's monkeypatch) for paths under the directory only; processes forked
afterwards (the tools' workers) inherit the patch.

    def test_full_disk(tmp_path, monkeypatch):
        full_disk(monkeypatch, tmp_path / "out", capacity=4096)   # writes fail past 4 KiB: ENOSPC
        read_only(monkeypatch, tmp_path / "ro")                   # creating anything fails: EROFS
"""
import builtins
import errno
import io
import os

_REAL_OPEN = builtins.open
_REAL_OS_OPEN = os.open
_REAL_MKDIR = os.mkdir
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


def _under(path, directory: str) -> bool:
    if not isinstance(path, (str, bytes, os.PathLike)):
        return False
    path = os.path.abspath(os.fsdecode(path))
    return path == directory or path.startswith(directory + os.sep)


def _writes(mode: str) -> bool:
    return any(flag in mode for flag in "wxa+")


class _LimitedFile(io.FileIO):
    """A file whose writes fail with ENOSPC once the directory's shared budget is spent."""

    def __init__(self, path, mode, budget: list):
        super().__init__(path, mode)
        self._budget = budget

    def write(self, data):
        if len(data) > self._budget[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._budget[0] -= len(data)
        return super().write(data)


def full_disk(monkeypatch, directory, capacity: int) -> None:
    """Files written under ``directory`` hold ``capacity`` bytes in all (per process); the write that
    would pass it fails with ENOSPC, as on a full disk."""
    directory = os.path.abspath(directory)
    budget = [capacity]

    def open_with_budget(file, mode="r", buffering=-1, encoding=None, errors=None, newline=None, *args, **kwargs):
        if not (_under(file, directory) and _writes(mode)):
            return _REAL_OPEN(file, mode, buffering, encoding, errors, newline, *args, **kwargs)
        raw_mode = mode.replace("b", "").replace("t", "")
        buffered = io.BufferedWriter(_LimitedFile(file, raw_mode, budget))
        return buffered if "b" in mode else io.TextIOWrapper(buffered, encoding=encoding, errors=errors,
                                                             newline=newline)

    monkeypatch.setattr(builtins, "open", open_with_budget)


def read_only(monkeypatch, directory) -> None:
    """Opening a file for writing (``open``, ``os.open``) or making a directory under ``directory``
    fails with EROFS."""
    directory = os.path.abspath(directory)

    def refuse(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))

    def open_read_only(file, mode="r", *args, **kwargs):
        if _under(file, directory) and _writes(mode):
            refuse(file)
        return _REAL_OPEN(file, mode, *args, **kwargs)

    def os_open_read_only(path, flags, *args, **kwargs):
        if _under(path, directory) and flags & _WRITE_FLAGS:
            refuse(path)
        return _REAL_OS_OPEN(path, flags, *args, **kwargs)

    def mkdir_read_only(path, *args, **kwargs):
        if _under(path, directory):
            refuse(path)
        return _REAL_MKDIR(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_read_only)
    monkeypatch.setattr(os, "open", os_open_read_only)
    monkeypatch.setattr(os, "mkdir", mkdir_read_only)
