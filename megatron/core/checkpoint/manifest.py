"""The checkpoint manifest: every file of a checkpoint with its size and CRC-32, so that a truncated,
bit-flipped, missing or foreign file is named before training reads it.

``manifest.json`` in the tag directory (``global_stepN/``), written after every rank has written
its files and before ``latest`` names the tag::

    {"format": "megatron-deepspeed-3d checkpoint manifest", "version": 1,
     "tag": "global_stepN", "iteration": N,
     "files": {"<path relative to the tag directory>": {"bytes": S, "crc32": "1a2b3c4d"}, ...}}

Writer side: each rank describes the files it wrote (``describe_file``: size and CRC-32 of the
bytes on disk, after ``fsync``), rank 0 writes the union (``write_manifest``: temporary name, fsync,
rename, then the directory entry is synced). Reader side: ``read_manifest`` checks the format,
``Manifest.check_present`` the listed files and their sizes (stat only), ``Manifest.verify_file``
one file's size and CRC (a full read). CRC-32 (zlib) runs at about 3 GB/s on one core.
"""
import json
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

MANIFEST_NAME = "manifest.json"
SAVING_MARKER = "saving.incomplete"  # in a tag directory from the start of its save until its manifest is written
FORMAT = "megatron-deepspeed-3d checkpoint manifest"
VERSION = 1
_CHUNK_BYTES = 64 * 1024 * 1024


class ManifestError(ValueError):
    """A checkpoint file does not match its manifest, or the manifest is unreadable; names the file."""


@dataclass(frozen=True)
class FileEntry:
    """Size in bytes and CRC-32 of one file."""

    size: int
    crc32: int


def file_crc32(path: str) -> int:
    """CRC-32 of the bytes of ``path``, read in 64 MiB chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


def fsync_path(path: str) -> None:
    """Flush a file, or a directory's entries, to the disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def describe_file(path: str) -> FileEntry:
    """The entry of a file just written: flushed to disk first, then measured as the disk holds it."""
    fsync_path(path)
    return FileEntry(os.path.getsize(path), file_crc32(path))


@dataclass(frozen=True)
class Manifest:
    """A parsed manifest: the tag, the iteration and the entry of every file (relative paths)."""

    path: str
    tag: str
    iteration: int
    files: dict[str, FileEntry]

    def check_present(self, tag_directory: str) -> None:
        """Every listed file exists with its size (no read)."""
        for name, entry in sorted(self.files.items()):
            path = os.path.join(tag_directory, name)
            if not os.path.isfile(path):
                raise ManifestError(f"{path} is missing (listed in {self.path})")
            size = os.path.getsize(path)
            if size != entry.size:
                raise ManifestError(f"{path} has {size} bytes, {self.path} records {entry.size}: the file is "
                                    f"truncated or from another checkpoint")

    def verify_file(self, path: str, tag_directory: str) -> None:
        """``path`` (a file of ``tag_directory``) has the size and CRC-32 its entry records."""
        name = os.path.relpath(path, tag_directory)
        entry = self.files.get(name)
        if entry is None:
            raise ManifestError(f"{path} is not listed in {self.path}: it does not belong to this checkpoint")
        size = os.path.getsize(path)
        if size != entry.size:
            raise ManifestError(f"{path} has {size} bytes, {self.path} records {entry.size}: the file is "
                                f"truncated or from another checkpoint")
        crc = file_crc32(path)
        if crc != entry.crc32:
            raise ManifestError(f"{path}: CRC-32 {crc:08x}, {self.path} records {entry.crc32:08x}: the file is "
                                f"damaged or from another checkpoint")


def write_manifest(tag_directory: str, iteration: int, files: Mapping[str, FileEntry]) -> str:
    """Write ``tag_directory``/manifest.json atomically and durably; return its path."""
    path = os.path.join(tag_directory, MANIFEST_NAME)
    document = {"format": FORMAT, "version": VERSION, "tag": os.path.basename(os.path.normpath(tag_directory)),
                "iteration": iteration,
                "files": {name: {"bytes": entry.size, "crc32": f"{entry.crc32:08x}"}
                          for name, entry in sorted(files.items())}}
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w") as f:
        json.dump(document, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    fsync_path(tag_directory)
    return path


def _entry(name: str, value, path: str) -> FileEntry:
    try:
        return FileEntry(int(value["bytes"]), int(value["crc32"], 16))
    except (KeyError, TypeError, ValueError):
        raise ManifestError(f"{path}: the entry of {name} is malformed: {value!r}") from None


def read_manifest(tag_directory: str) -> Manifest | None:
    """The manifest of ``tag_directory``; None when the checkpoint has none (an older trainer's, or
    Megatron-DeepSpeed's). A manifest that cannot be read raises ManifestError naming it."""
    path = os.path.join(tag_directory, MANIFEST_NAME)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            document = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ManifestError(f"{path} cannot be read ({type(error).__name__}: {error})") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ManifestError(f"{path} is not a checkpoint manifest")
    if document.get("version") != VERSION:
        raise ManifestError(f"{path}: manifest version {document.get('version')!r} is not supported (expected {VERSION})")
    files = document.get("files")
    if not isinstance(files, dict) or not isinstance(document.get("iteration"), int):
        raise ManifestError(f"{path}: the files or the iteration are missing")
    return Manifest(path, str(document.get("tag")), document["iteration"],
                    {name: _entry(name, value, path) for name, value in files.items()})
