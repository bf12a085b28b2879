"""Run pretrain_gpt.py as a subprocess on CPU and read what it prints.

``preprocessed_corpus`` (a session fixture, registered in tests/conftest.py) tokenizes the sample
corpus with the session's 4k GPT-2 tokenizer into an indexed dataset, once per session (the index
caches runs write beside it are keyed by their parameters). ``run_pretrain`` starts one process (plain
``python``, on a free rendezvous port) or several ranks (tests.training.e2e_utils.run_ranks).
``training_lines`` / ``validation_lines`` read the log lines through megatron.training.log_reader.
"""
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from megatron.training.log_reader import iteration_records, validation_records
from tests.conftest import REPO_ROOT, SAMPLE_CORPUS
from tests.dist_utils import free_port
from tests.training.e2e_utils import run_script

PRETRAIN = os.path.join(REPO_ROOT, "pretrain_gpt.py")
TINY_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
              "--max-position-embeddings", "64"]


@dataclass(frozen=True)
class Corpus:
    data_prefix: str
    vocab_file: str
    merge_file: str

    def args(self) -> list[str]:
        return ["--data-path", self.data_prefix, "--vocab-file", self.vocab_file, "--merge-file", self.merge_file]


@pytest.fixture(scope="session")
def preprocessed_corpus(tmp_path_factory, gpt2_tokenizer_files):
    vocab_file, merge_file = gpt2_tokenizer_files
    output = tmp_path_factory.mktemp("corpus")
    subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "preprocess_data.py"), "--input", SAMPLE_CORPUS,
                    "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab_file, "--merge-file", merge_file,
                    "--append-eod", "--output-prefix", str(output / "docs"), "--workers", "1"],
                   check=True, capture_output=True, cwd=REPO_ROOT)
    return Corpus(str(output / "docs_text_document"), vocab_file, merge_file)


def tiny_run_args(corpus: Corpus, *extra: str) -> list[str]:
    """A 2-layer, h=64, s=64 GPT on the corpus; no loader workers, to keep start-up short."""
    return TINY_MODEL + corpus.args() + ["--micro-batch-size", "2", "--lr", "1e-3", "--log-interval", "1",
                                         "--num-workers", "0", "--valid-num-workers", "0", *extra]


def run_pretrain(args: list[str], nproc: int = 1, timeout: float = 300, check: bool = True,
                 env: dict | None = None, script: str = PRETRAIN) -> subprocess.CompletedProcess:
    """``script`` (pretrain_gpt.py) with ``args`` on ``nproc`` CPU processes (ranks started directly, see
    tests.training.e2e_utils.run_ranks); stdout and stderr merged into ``.stdout``; killed past ``timeout``."""
    if nproc == 1:
        env = {"MASTER_PORT": str(free_port()), **(env or {})}
    result = run_script([script, *args], nproc, env=env, timeout=timeout)
    if result.timed_out or (check and result.returncode != 0):
        result.assert_ok()
    return subprocess.CompletedProcess(result.command, result.returncode, stdout=result.output)


def _value(text: str):
    return float(text.rstrip("%")) if re.fullmatch(r"[-+0-9.Ee]+%?", text) else text


def training_lines(output: str) -> list[dict]:
    """Each log line (megatron.training.log_reader) as {"iteration", "train_iters", field name: value};
    numbers parsed, fields in print order; every `` |`` of a line closes one field."""
    lines = []
    for record in iteration_records(output):
        assert record.text.count(" |") == len(record.fields) + 1, f"malformed log line: {record.text!r}"
        lines.append({"iteration": record.iteration, "train_iters": record.train_iters,
                      **{name: _value(value) for name, value in record.fields.items()}})
    return lines


def validation_lines(output: str) -> list[tuple[str, str, float, float]]:
    """(set label, what the loss is at, loss, ppl) of each evaluation; checks the dash lines around it."""
    lines = output.splitlines()
    found = []
    for record in validation_records(output):
        line = lines[record.line_number - 1]
        dashes = "-" * (len(line) + 1)
        assert lines[record.line_number - 2] == dashes and lines[record.line_number] == dashes, line
        found.append((record.set_name, record.prefix.split(" loss at ", 1)[1], record.loss, record.ppl))
    return found
