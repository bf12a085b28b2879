"""The checkpoint conversion tools never launder damage and never leave a traceback or a partial output.

- Input without its manifest: a checkpoint of this trainer whose manifest.json was deleted and one of
  whose layer files has a flipped bit is refused by all five tools (ds_to_universal,
  deepspeed_to_deepspeed, deepspeed_to_megatron, deepspeed_to_transformers, merge_mp_partitions),
  naming the flag that allows it; with that flag they convert after a warning, and write no manifest
  that would vouch for what they could not verify.
- An output that cannot be written (a read-only filesystem, a path through a file, a disk that fills
  mid-conversion; injected by tests/disk_faults.py, as the tests run as root): one line naming the
  output and the cause, nothing left under the output's name and no hidden partial directory (the
  imports of transformers models: the GPT-2 export of that checkpoint and a tiny Llama).

The input is the session's TP=2 x PP=2 checkpoint (tests/tasks/trained_checkpoint.py); every tool runs
in this process (ds_to_universal with one extraction process, so the injected faults reach it).
"""
import os
import shutil

import pytest

from megatron.core.checkpoint.manifest import MANIFEST_NAME
from tests.disk_faults import full_disk, read_only
from tests.tasks.trained_checkpoint import checkpoint_path
from tests.tools.test_llama_conversion import tiny_model
from tools import merge_mp_partitions
from tools.convert_checkpoint import (deepspeed_to_deepspeed, deepspeed_to_megatron, deepspeed_to_transformers,
                                      ds_to_universal, transformers_to_megatron)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # the session checkpoint takes 4 gloo processes

LAYER = "layer_03-model_01-model_states.pt"


def tool_runs(source: str) -> dict:
    """name -> (main, arguments, the spelling of its flag that allows a missing manifest) of each tool
    converting ``source``; the output's value is set by ``with_output``."""
    output = ""
    return {
        "ds_to_universal": (ds_to_universal.main, ["--input_folder", source, "--output_folder", output,
                                                   "--num_extract_workers", "1"], "--allow_missing_manifest"),
        "deepspeed_to_deepspeed": (deepspeed_to_deepspeed.main, ["--input_folder", source, "--output_folder", output,
                                                                 "--target_tp", "1"], "--allow_missing_manifest"),
        "deepspeed_to_megatron": (deepspeed_to_megatron.main, ["--input_folder", source, "--output_folder", output],
                                  "--allow_missing_manifest"),
        "deepspeed_to_transformers": (deepspeed_to_transformers.main, ["--input_folder", source, "--output_folder",
                                                                       output], "--allow_missing_manifest"),
        "merge_mp_partitions": (merge_mp_partitions.main, ["--model-type", "GPT", "--tensor-model-parallel-size", "2",
                                                           "--load", source, "--save", output],
                                "--allow-missing-manifest"),
    }


def flip_a_bit(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))


def error_lines(captured: str) -> list[str]:
    return [line for line in captured.splitlines() if line.startswith("error: ")]


def leftovers(directory) -> list[str]:
    """Hidden names in ``directory``: what a conversion's staging would leave."""
    return sorted(name for name in os.listdir(directory) if name.startswith("."))


@pytest.fixture
def without_manifest(trained, tmp_path) -> str:
    """A copy of the session checkpoint's global_step2 without manifest.json, with a bit flipped in a layer."""
    _, save = trained
    copy = str(tmp_path / "input" / "global_step2")
    shutil.copytree(checkpoint_path(save), copy)
    os.remove(os.path.join(copy, MANIFEST_NAME))
    flip_a_bit(os.path.join(copy, LAYER))
    return copy


def test_input_without_its_manifest_is_refused_by_every_tool(without_manifest, tmp_path, capsys):
    outputs = tmp_path / "outputs"
    for name, (main, arguments, allow_flag) in tool_runs(without_manifest).items():
        assert main(with_output(arguments, outputs / name)) == 1, name
        errors = error_lines(capsys.readouterr().err)
        assert len(errors) == 1, (name, errors)
        assert (f"{without_manifest} has no {MANIFEST_NAME}, though this trainer wrote it" in errors[0]
                and f"add {allow_flag} to read them unverified" in errors[0]), (name, errors[0])
    assert not outputs.exists()
    assert leftovers(tmp_path) == []


def test_the_flag_converts_loudly_and_writes_no_manifest(without_manifest, tmp_path, capsys):
    runs = tool_runs(without_manifest)
    for name in ("ds_to_universal", "deepspeed_to_deepspeed", "deepspeed_to_megatron"):
        main, arguments, allow_flag = runs[name]
        output = tmp_path / "outputs" / name
        assert main(with_output(arguments, output) + [allow_flag]) == 0, name
        captured = capsys.readouterr()
        assert f"WARNING: {without_manifest} has no {MANIFEST_NAME}" in captured.err
        assert "read UNVERIFIED" in captured.err
        assert "no manifest written (the input was read unverified)" in captured.out
        written = [file for _, _, files in os.walk(output) for file in files]
        assert written and MANIFEST_NAME not in written, (name, written)


def with_output(arguments: list[str], output) -> list[str]:
    """``arguments`` with the output flag's value replaced by ``output``."""
    index = next(i for i, argument in enumerate(arguments) if argument in ("--output_folder", "--save")) + 1
    return arguments[:index] + [str(output)] + arguments[index + 1:]


def inject(monkeypatch, fault: str, target) -> tuple[str, str]:
    """(the directory to write outputs into, the cause the error must name) under ``fault``."""
    if fault == "read-only":
        read_only(monkeypatch, target)
        return str(target), "Read-only file system (EROFS)"
    if fault == "path through a file":
        (target / "notes.txt").write_text("")
        return str(target / "notes.txt" / "sub"), "Not a directory (ENOTDIR)"
    full_disk(monkeypatch, target, capacity=200_000)  # a layer file holds 100 to 150 kB
    return str(target), "No space left on device (ENOSPC)"


@pytest.mark.parametrize("fault", ["read-only", "path through a file", "full"])
def test_an_unwritable_output_is_one_line_and_leaves_nothing(trained, tmp_path, capsys, monkeypatch, fault):
    _, save = trained
    exported = tmp_path / "hf"  # the import's input, written before any fault
    assert deepspeed_to_transformers.main(["--input_folder", checkpoint_path(save), "--output_folder",
                                           str(exported)]) == 0
    llama = tmp_path / "llama"  # a Llama-class import too: its untied output layer is one more layer file
    tiny_model("llama").save_pretrained(str(llama))
    runs = [(main, arguments) for main, arguments, _ in tool_runs(checkpoint_path(save)).values()]
    runs += [(transformers_to_megatron.main, ["--input_folder", str(exported), "--output_folder", ""]),
             (transformers_to_megatron.main, ["--input_folder", str(llama), "--output_folder", "", "--target_tp", "2"])]
    target = tmp_path / "target"
    target.mkdir()
    for main, arguments in runs:
        capsys.readouterr()
        parent, cause = inject(monkeypatch, fault, target)  # again for each tool: a fresh capacity
        output = os.path.join(parent, main.__module__.rpartition(".")[2])
        assert main(with_output(arguments, output)) == 1, output
        captured = capsys.readouterr().err
        errors = error_lines(captured)
        assert len(errors) == 1 and "Traceback" not in captured, captured[-3000:]
        assert f"cannot write" in errors[0] and output in errors[0] and cause in errors[0], errors[0]
        assert not os.path.exists(output)
    assert sorted(os.listdir(target)) == (["notes.txt"] if fault == "path through a file" else [])
