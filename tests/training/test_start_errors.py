"""The first minutes of a run, end to end: errors reported once, before any process group or model,
with nothing written; the console kept short (listings go to --log-path, one line each).

Every run here starts 2 ranks (stopped, as torchrun stops them, when one fails), as a user's first launch would.
"""
import os
import re
import struct

import pytest

from tests.training.e2e_utils import run_pretrain, tiny_gpt_flags

pytestmark = pytest.mark.distributed

RUN_FLAGS = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3",
             "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1"]
STARTED = "> initializing torch distributed"


def flags_with_data_path(data, data_path: str, tmp_path) -> list[str]:
    flags = tiny_gpt_flags(data) + RUN_FLAGS + ["--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                                                "--tensorboard-dir", str(tmp_path / "tb"),
                                                "--log-path", str(tmp_path / "logs")]
    flags[flags.index("--data-path") + 1] = data_path
    return flags


@pytest.mark.parametrize("make_path, hint", [
    (lambda prefix: prefix[:-len("_text_document")], "{prefix}"),
    (lambda prefix: prefix + ".bin", "without the .bin extension: {prefix}"),
    (lambda prefix: prefix + ".idx", "without the .idx extension: {prefix}"),
])
def test_a_wrong_data_path_is_one_error_before_anything_starts(e2e_data, tmp_path, make_path, hint):
    given = make_path(e2e_data.data_prefix)
    result = run_pretrain(flags_with_data_path(e2e_data, given, tmp_path), nproc=2)
    assert result.returncode != 0
    errors = [line for line in result.output.splitlines() if "pretrain_gpt.py: error:" in line]
    assert len(errors) == 1, result.output
    assert f"--data-path: {given}: no dataset at this prefix" in errors[0]
    assert hint.format(prefix=e2e_data.data_prefix) in errors[0]
    assert STARTED not in result.output and "estimated model parameters" not in result.output
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "tb").exists() and not (tmp_path / "logs").exists()


def test_a_damaged_dataset_is_named_before_anything_starts(e2e_data, tmp_path):
    prefix = str(tmp_path / "cut_text_document")
    with open(e2e_data.data_prefix + ".idx", "rb") as source, open(prefix + ".idx", "wb") as target:
        target.write(source.read())
    with open(e2e_data.data_prefix + ".bin", "rb") as source, open(prefix + ".bin", "wb") as target:
        target.write(source.read()[:-10])
    result = run_pretrain(flags_with_data_path(e2e_data, prefix, tmp_path), nproc=2)
    errors = [line for line in result.output.splitlines() if "pretrain_gpt.py: error:" in line]
    assert result.returncode != 0 and len(errors) == 1, result.output
    assert f"--data-path: {prefix}.bin: data file has" in errors[0] and STARTED not in result.output
    assert not (tmp_path / "ckpt").exists()


def test_a_bad_flag_is_reported_once(e2e_data, tmp_path):
    flags = tiny_gpt_flags(e2e_data) + RUN_FLAGS + ["--num-attention-heads", "3"]
    result = run_pretrain(flags, nproc=2)
    errors = [line for line in result.output.splitlines() if "pretrain_gpt.py: error:" in line]
    assert result.returncode != 0 and len(errors) == 1 and "--num-attention-heads" in errors[0], result.output
    assert STARTED not in result.output


@pytest.fixture(scope="module")
def quiet_run(e2e_data, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("logs")
    flags = tiny_gpt_flags(e2e_data) + RUN_FLAGS + ["--log-path", str(log_path), "--distributed-backend", "gloo"]
    result = run_pretrain(flags, nproc=2)
    result.assert_ok()
    return result, log_path


def test_listings_go_to_the_log_path_with_one_console_line_each(quiet_run):
    result, log_path = quiet_run
    files = sorted(os.listdir(log_path))
    assert [name.split("_")[0] for name in files] == ["args", "model"], files
    arguments = open(os.path.join(log_path, files[0])).read()
    assert re.search(r"^  data_parallel_size \.+ 2$", arguments, re.MULTILINE)
    assert re.search(r"^  num_layers \.+ 2$", arguments, re.MULTILINE)
    layers = open(os.path.join(log_path, files[1])).read()
    assert "ParallelTransformerLayerPipe" in layers and "stage=0" in layers
    output = result.output
    assert "------------------------ arguments" not in output and "ParallelTransformerLayerPipe" not in output
    assert len(re.findall(rf"^> arguments: .* listing in {re.escape(str(log_path))}/args_", output, re.MULTILINE)) == 1
    assert len(re.findall(rf"^> model: GPTModelPipe .* in {re.escape(str(log_path))}/model_", output,
                          re.MULTILINE)) == 1


def test_no_per_rank_warnings_on_the_console(quiet_run):
    result, _ = quiet_run
    assert "FutureWarning" not in result.output and "all_gather_into_tensor" not in result.output
    assert "notice: --distributed-backend" not in result.output


def _patch(offset, fmt, value):
    def mutate(raw):
        struct.pack_into(fmt, raw, offset, value)
        return raw
    return mutate


SIZES = 34  # the .idx header's size: sizes (int32) follow, then pointers (int64), then the document index
# (which file, how it is damaged, what the error says): each refused before any process group.
DATASET_DAMAGES = {
    "bad magic": ("idx", lambda raw: b"NOTANIDX\x00" + raw[9:], "bad magic"),
    "legacy format": ("idx", lambda raw: b"TNTIDX\x00\x00" + raw[8:], "legacy lazy/cached (TNTIDX) format"),
    "unknown version": ("idx", _patch(9, "<Q", 7), "unsupported index version 7"),
    "unknown dtype": ("idx", _patch(17, "<B", 42), "unknown dtype code 42"),
    "truncated index": ("idx", lambda raw: raw[:-5], "truncated index"),
    "truncated data": ("bin", lambda raw: raw[:-10], "data file has"),
    "negative size": ("idx", _patch(SIZES + 4, "<i", -1), "has a negative size"),
    "shifted pointer": ("idx", lambda raw: _shift_second_pointer(raw), "pointers are inconsistent with item sizes"),
    "missing data file": ("bin", None, "only"),
}


def _shift_second_pointer(raw):
    count = struct.unpack_from("<Q", raw, 18)[0]
    offset = SIZES + 4 * count + 8
    struct.pack_into("<q", raw, offset, struct.unpack_from("<q", raw, offset)[0] + 2)
    return raw


@pytest.mark.parametrize("damage", sorted(DATASET_DAMAGES))
def test_a_damaged_dataset_is_named_before_anything_starts_each_kind(e2e_data, tmp_path, damage):
    which, mutate, message = DATASET_DAMAGES[damage]
    prefix = tmp_path / "copy_text_document"
    for extension in ("idx", "bin"):
        with open(e2e_data.data_prefix + f".{extension}", "rb") as f:
            raw = bytearray(f.read())
        if extension == which:
            if mutate is None:
                continue
            raw = mutate(raw)
        (tmp_path / f"copy_text_document.{extension}").write_bytes(bytes(raw))
    result = run_pretrain(flags_with_data_path(e2e_data, str(prefix), tmp_path), nproc=1)
    errors = [line for line in result.output.splitlines() if "pretrain_gpt.py: error:" in line]
    assert result.returncode == 2 and len(errors) == 1, result.output[-3000:]
    assert f"--data-path: {prefix}" in errors[0] and message in errors[0], errors[0]
    assert STARTED not in result.output and not (tmp_path / "ckpt").exists()
