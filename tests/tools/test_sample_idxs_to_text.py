"""tools/sample_idxs_to_text.py: the text of the samples iterations consumed, checked against the training
dataset built independently (reference_loop.training_dataset, the samples the trainer reads in order)."""
import os
import subprocess
import sys

import pytest

from megatron.core.tokenizer import build_tokenizer
from tests.conftest import REPO_ROOT
from tests.disk_faults import read_only
from tests.training.reference_loop import training_dataset
from tools.sample_idxs_to_text import main

SEQ, SEED, GLOBAL_BATCH, ITERS = 64, 1234, 4, 10


def run_flags(data, length=("--train-iters", str(ITERS))):
    return ["--data-path", data.data_prefix, "--split", "100,0,0", "--data-cache-path", data.cache_dir,
            "--seq-length", str(SEQ), "--seed", str(SEED), *length, "--global-batch-size", str(GLOBAL_BATCH),
            "--eval-iters", "0", "--vocab-file", data.vocab_file, "--merge-file", data.merge_file]


def blocks(text):
    """[(header, body)] of the tool's output."""
    found = []
    for line in text.splitlines():
        if line.startswith("=== sample "):
            found.append([line, []])
        else:
            found[-1][1].append(line)
    return [(header, "\n".join(body)) for header, body in found]


def test_iterations_map_to_their_samples_and_text(e2e_data, capsys):
    main(run_flags(e2e_data) + ["--iteration-range", "3", "4", "--print-tokens", "--print-text"])
    printed = blocks(capsys.readouterr().out)
    dataset = training_dataset(e2e_data.data_prefix, SEQ, SEED, ITERS * GLOBAL_BATCH, e2e_data.cache_dir)
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=e2e_data.vocab_file, merge_file=e2e_data.merge_file)
    assert [header for header, _ in printed] == [
        f"=== sample {n} (iteration {3 + (n - 8) // 4}, {SEQ} tokens) ===" for n in range(8, 16)]
    for (_, body), sample in zip(printed, range(8, 16)):
        tokens = dataset[sample]["text"].tolist()[:-1]
        ids, text = body.split("\n", 1)
        assert [int(t) for t in ids.split()] == tokens and text == tokenizer.detokenize(tokens)


def test_sample_ids_with_a_rampup_and_all_tokens(e2e_data, tmp_path):
    output = tmp_path / "samples.txt"
    # rampup 2 2 8 to 4: gbs(c) = 2 + 2 floor(c / 8) while c <= 8, then 4: batches 2, 2, 2, 2, 4, ...,
    # so the iterations start at c = 0, 2, 4, 6, 8, 12, ...
    main(run_flags(e2e_data, ("--train-samples", "40")) + ["--rampup-batch-size", "2", "2", "8", "--sample-id-range",
                                                            "1", "7", "--all-tokens", "--output-file", str(output)])
    headers = [header for header, _ in blocks(output.read_text())]
    assert headers == [f"=== sample {n} (iteration {k}, {SEQ + 1} tokens) ===" for n, k in
                       ((1, 1), (2, 2), (3, 2), (4, 3), (5, 3), (6, 4))]


@pytest.mark.parametrize("extra, message", [
    (["--iteration-range", "5", "2"], "1 <= FIRST <= LAST"),
    (["--sample-id-range", "3", "3"], "0 <= START < END"),
    (["--iteration-range", "100000", "100001"], "samples 399996..400003 are not all in it"),
    ([], "one of the arguments --iteration-range --sample-id-range is required"),
])
def test_bad_ranges_are_named(e2e_data, extra, message):
    result = subprocess.run([sys.executable, "tools/sample_idxs_to_text.py", *run_flags(e2e_data), *extra],
                            cwd=REPO_ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.mark.parametrize("fault", ["missing directory", "read-only"])
def test_an_unwritable_output_file_is_one_line_and_leaves_nothing(e2e_data, tmp_path, monkeypatch, fault):
    out = tmp_path / "out"
    out.mkdir()
    target = out / "missing" / "samples.txt" if fault == "missing directory" else out / "samples.txt"
    if fault == "read-only":
        read_only(monkeypatch, out)
    with pytest.raises(SystemExit) as exit_info:
        main(run_flags(e2e_data) + ["--sample-id-range", "0", "2", "--output-file", str(target)])
    monkeypatch.undo()
    cause = "No such file or directory" if fault == "missing directory" else "Read-only file system"
    assert exit_info.value.code == f"error: --output-file {target}: cannot write it: {cause}"
    assert os.listdir(out) == []
