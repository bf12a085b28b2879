"""Run pretrain_gpt.py as a subprocess on CPU and read what it prints.

``preprocessed_corpus`` (a fixture: import it into a test module) tokenizes the sample corpus with
the session's 4k GPT-2 tokenizer into an indexed dataset, once per module. ``run_pretrain`` starts
one process (plain ``python``, on a free rendezvous port) or several (``python -m
torch.distributed.run``). ``training_lines`` / ``validation_lines`` parse Megatron-DeepSpeed's log lines.
"""
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.conftest import REPO_ROOT, SAMPLE_CORPUS
from tests.dist_utils import free_port
from tests.training.e2e_utils import run_command

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


@pytest.fixture(scope="module")
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
    """``script`` (pretrain_gpt.py) with ``args`` on ``nproc`` CPU processes; stdout and stderr merged
    into ``.stdout``. Started and, past ``timeout``, killed with its whole process group by
    tests.training.e2e_utils.run_command."""
    if nproc == 1:
        env = {"MASTER_PORT": str(free_port()), **(env or {})}
        command = [sys.executable, script, *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                   "--master_port", str(free_port()), script, *args]
    result = run_command(command, env=env, timeout=timeout)
    if result.timed_out or (check and result.returncode != 0):
        result.assert_ok()
    return subprocess.CompletedProcess(command, result.returncode, stdout=result.output)


_ITERATION = re.compile(r"^ iteration +(\d+)/ *(\d+) \|(.*)$")


def training_lines(output: str) -> list[dict]:
    """Each log line as {"iteration", "train_iters", field name: value}; numbers parsed, fields in order."""
    lines = []
    for line in output.splitlines():
        match = _ITERATION.match(line)
        if not match:
            continue
        fields = {"iteration": int(match.group(1)), "train_iters": int(match.group(2))}
        segments = match.group(3).split(" |")
        if segments[-1] != "":
            raise AssertionError(f"log line does not end with ' |': {line!r}")
        for segment in segments[:-1]:
            if not segment.startswith(" ") or ": " not in segment:
                raise AssertionError(f"malformed segment {segment!r} in {line!r}")
            key, value = segment[1:].rsplit(": ", 1)
            value = value.strip()
            fields[key] = float(value.rstrip("%")) if re.fullmatch(r"[-+0-9.Ee]+%?", value) else value
        lines.append(fields)
    return lines


_VALIDATION = re.compile(r"^(.+) loss at (.+) \| lm loss value: (\S+) \| lm loss PPL: (\S+) \| $")


def validation_lines(output: str) -> list[tuple[str, str, float, float]]:
    """(set label, prefix, loss, ppl) of each evaluation; checks the dash lines around it."""
    lines = output.splitlines()
    found = []
    for index, line in enumerate(lines):
        match = _VALIDATION.match(line)
        if match:
            dashes = "-" * (len(line) + 1)
            assert lines[index - 1] == dashes and lines[index + 1] == dashes, line
            found.append((match.group(1), match.group(2), float(match.group(3)), float(match.group(4))))
    return found
