"""The checkpoint manifest: written, read back, and every kind of mismatch named."""
import json
import os
import zlib

import pytest

from megatron.core.checkpoint.manifest import (MANIFEST_NAME, FileEntry, ManifestError, describe_file, file_crc32,
                                               read_manifest, write_manifest)


@pytest.fixture
def tag(tmp_path):
    """A tag directory with two files and their manifest."""
    directory = tmp_path / "global_step7"
    directory.mkdir()
    (directory / "a.pt").write_bytes(b"weights" * 1000)
    (directory / "sub").mkdir()
    (directory / "sub" / "b.pt").write_bytes(b"optimizer")
    entries = {name: describe_file(str(directory / name)) for name in ("a.pt", os.path.join("sub", "b.pt"))}
    write_manifest(str(directory), 7, entries)
    return directory


def test_entries_are_size_and_zlib_crc32(tmp_path):
    path = tmp_path / "f"
    data = os.urandom(3 * 1024 * 1024 + 5)
    path.write_bytes(data)
    assert describe_file(str(path)) == FileEntry(len(data), zlib.crc32(data)) and file_crc32(str(path)) == zlib.crc32(data)


def test_round_trip(tag):
    manifest = read_manifest(str(tag))
    assert (manifest.tag, manifest.iteration, sorted(manifest.files)) == ("global_step7", 7, ["a.pt", "sub/b.pt"])
    document = json.loads((tag / MANIFEST_NAME).read_text())
    assert document["files"]["sub/b.pt"] == {"bytes": 9, "crc32": f"{zlib.crc32(b'optimizer'):08x}"}
    manifest.check_present(str(tag))
    for name in manifest.files:
        manifest.verify_file(str(tag / name), str(tag))
    assert not [name for name in os.listdir(tag) if ".tmp" in name]


def test_no_manifest_is_none(tmp_path):
    assert read_manifest(str(tmp_path)) is None


def flip_a_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, check, message", [
    (lambda tag: flip_a_bit(tag / "a.pt"), "verify", r"a\.pt: CRC-32 .* damaged or from another checkpoint"),
    (lambda tag: (tag / "a.pt").write_bytes(b"weights" * 999), "present", r"a\.pt has 6993 bytes, .* records 7000"),
    (lambda tag: (tag / "a.pt").unlink(), "present", r"a\.pt is missing"),
    (lambda tag: (tag / "extra.pt").write_bytes(b"x"), "verify extra", r"extra\.pt is not listed"),
    (lambda tag: (tag / "sub" / "b.pt").write_bytes(b"OPTIMIZER"), "verify b", r"b\.pt: CRC-32"),
])
def test_mismatches_are_named(tag, damage, check, message):
    damage(tag)
    manifest = read_manifest(str(tag))
    with pytest.raises(ManifestError, match=message):
        if check == "present":
            manifest.check_present(str(tag))
        else:
            name = {"verify": "a.pt", "verify extra": "extra.pt", "verify b": "sub/b.pt"}[check]
            manifest.verify_file(str(tag / name), str(tag))


@pytest.mark.parametrize("text, message", [
    ("{not json", "cannot be read"), ("[1, 2]", "is not a checkpoint manifest"),
    ('{"format": "something else"}', "is not a checkpoint manifest"),
    ('{"format": "megatron-deepspeed-3d checkpoint manifest", "version": 9}', "version 9 is not supported"),
    ('{"format": "megatron-deepspeed-3d checkpoint manifest", "version": 1, "iteration": 7, '
     '"files": {"a.pt": {"bytes": 3}}}', "the entry of a.pt is malformed"),
])
def test_an_unreadable_manifest_is_named(tag, text, message):
    (tag / MANIFEST_NAME).write_text(text)
    with pytest.raises(ManifestError, match=message) as error:
        read_manifest(str(tag))
    assert str(tag / MANIFEST_NAME) in str(error.value)
