"""Helpers of the end-to-end tests: real ``pretrain_gpt.py`` runs, read back from their stdout and
TensorBoard files. Several ranks start directly, with the variables torchrun would give them
(run_ranks); the tests of the launchers themselves run torchrun, deepspeed or srun (torchrun_command,
executable).

    def test_run(e2e_data, tmp_path):               # e2e_data: tokenizer + .bin/.idx, once per session
        flags = tiny_gpt_flags(e2e_data) + ["--train-iters", "5", ...]
        result = run_pretrain(flags, nproc=2)       # 2 ranks, CPU, gloo
        result.assert_ok()
        lines = result.log_lines()                  # the per-iteration log line, parsed
        scalars = read_scalars(tensorboard_dir)     # {tag: [(step, value), ...]}

Every subprocess runs without any launcher variable inherited from the calling shell, on CPU
(``CUDA_VISIBLE_DEVICES`` empty, ``DS_ACCELERATOR=cpu``, one thread per process) unless a GPU test
asks otherwise, and is killed (with its process group) when it outruns its timeout. Every timeout
is multiplied by MEGATRON_TEST_TIMEOUT_SCALE (default 1; e.g. 3 on a machine shared with other jobs).
On a machine without CUDA the trainer's processes are forked from a warm interpreter that has
imported torch and DeepSpeed (warm_launcher.py); MEGATRON_TEST_WARM=0 starts each as a new one.
"""
import glob
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import pytest

from megatron.training.log_reader import IterationRecord, iteration_records, validation_records
from tests.conftest import REPO_ROOT, SAMPLE_CORPUS
from tests.dist_utils import free_port
from tests.training.warm_launcher import WarmProcess

PRETRAIN_SCRIPT = os.path.join(REPO_ROOT, "pretrain_gpt.py")
EXAMPLES_DIR = os.path.join(REPO_ROOT, "examples")
# The tokenizer's vocabulary; 1000 is not a multiple of 128, so padding always happens.
TOKENIZER_VOCAB_SIZE = 1000
DEFAULT_TIMEOUT = 240
# How long the other ranks of a failed job get to stop on SIGTERM before SIGKILL (torchrun waits 30 s).
RANK_STOP_GRACE = 30
# Variables a launcher or a SLURM allocation sets; a test decides them, never the calling shell.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE")


# ---------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class E2EData:
    """The sample corpus tokenized for training.

    vocab_file, merge_file: a GPT-2-format BPE of TOKENIZER_VOCAB_SIZE tokens trained on the corpus;
    data_prefix: the ``--data-path`` of the preprocessed documents; cache_dir: ``--data-cache-path``
    shared by the runs of the session (index caches are keyed by their parameters).
    """

    vocab_file: str
    merge_file: str
    data_prefix: str
    cache_dir: str


def prepare_corpus(directory: str) -> E2EData:
    """Train the tokenizer on the sample corpus and preprocess the corpus with it, into ``directory``."""
    from tools.train_tokenizer import train_tokenizer

    tokenizer_dir = os.path.join(directory, "tokenizer")
    summary = train_tokenizer([SAMPLE_CORPUS], tokenizer_dir, vocab_size=TOKENIZER_VOCAB_SIZE)
    prefix = os.path.join(directory, "docs")
    command = [sys.executable, os.path.join(REPO_ROOT, "tools", "preprocess_data.py"), "--input", SAMPLE_CORPUS,
               "--json-keys", "text", "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
               summary["vocab_file"], "--merge-file", summary["merge_file"], "--append-eod", "--workers", "2",
               "--output-prefix", prefix]
    run_command(command, timeout=120).assert_ok()
    cache_dir = os.path.join(directory, "index_cache")
    os.makedirs(cache_dir, exist_ok=True)
    return E2EData(summary["vocab_file"], summary["merge_file"], prefix + "_text_document", cache_dir)


@pytest.fixture(scope="session")
def e2e_data(tmp_path_factory) -> E2EData:
    """The tokenized sample corpus (see E2EData), prepared once per session: tests/conftest.py registers
    this module as a plugin, so test modules ask for the fixture without importing it."""
    return prepare_corpus(str(tmp_path_factory.mktemp("e2e_corpus")))


def tiny_gpt_flags(data: E2EData, *, seq_length: int = 64, split: str = "98,1,1",
                   num_layers: int = 2) -> list[str]:
    """Model and data flags of the tiny GPT: ``num_layers`` layers, hidden 64, 4 heads, sequence ``seq_length``.

    Batch sizes, training length, learning rate and logging are left to the caller.
    """
    return ["--num-layers", str(num_layers), "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
            "--data-path", data.data_prefix, "--split", split, "--data-cache-path", data.cache_dir,
            "--vocab-file", data.vocab_file, "--merge-file", data.merge_file,
            "--num-workers", "0", "--valid-num-workers", "0"]


# ---------------------------------------------------------------------------------------- running


def scaled_timeout(seconds: float) -> float:
    """``seconds`` times MEGATRON_TEST_TIMEOUT_SCALE: the same run takes longer on a loaded machine."""
    text = os.environ.get("MEGATRON_TEST_TIMEOUT_SCALE", "1")
    try:
        scale = float(text)
    except ValueError:
        raise ValueError(f"MEGATRON_TEST_TIMEOUT_SCALE={text!r}: give a positive number") from None
    if scale <= 0:
        raise ValueError(f"MEGATRON_TEST_TIMEOUT_SCALE={text!r}: give a positive number")
    return seconds * scale


def subprocess_env(overrides: dict | None = None, cpu_only: bool = True) -> dict:
    """os.environ for a child: launcher and SLURM variables removed, CUDA hidden and one thread per
    process when ``cpu_only``, then ``overrides``."""
    env = {key: value for key, value in os.environ.items()
           if key not in LAUNCHER_VARIABLES and not key.startswith("SLURM_")}
    env.update(PYTHONUNBUFFERED="1", LOGLEVEL="WARNING",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")])))
    if cpu_only:
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.update(overrides or {})
    return env


@dataclass
class RunResult:
    """A finished subprocess: its command, exit status and combined stdout + stderr."""

    command: list[str]
    returncode: int
    output: str
    timed_out: bool = False

    def assert_ok(self):
        if self.returncode != 0 or self.timed_out:
            status = "timed out" if self.timed_out else f"exited with {self.returncode}"
            raise AssertionError(f"{' '.join(self.command)}\n{status}; last output:\n{self.output[-6000:]}")

    def log_lines(self) -> list["LogLine"]:
        return parse_log_lines(self.output)

    def validation_losses(self) -> list[tuple[str, float, float]]:
        return parse_validation_lines(self.output)


@dataclass
class ProcessSpec:
    """One process to start: command, extra environment, working directory, CPU only or not."""

    command: list[str]
    env: dict = field(default_factory=dict)
    cwd: str = REPO_ROOT
    cpu_only: bool = True


def start_process(command: list[str], env: dict, cwd: str, output, cpu_only: bool = True):
    """``command`` started in its own session, stdout and stderr into ``output`` (a named file open for
    writing): a subprocess.Popen, or for the trainer on a CPU machine a WarmProcess forked from the warm
    launcher (tests/training/warm_launcher.py), which skips the imports of a new interpreter."""
    if cpu_only and _warm_trainer(command):
        return WarmProcess(command[1:], env, cwd, output.name)
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)


def _warm_trainer(command: list[str]) -> bool:
    """``python pretrain_gpt.py ...`` on a machine without CUDA, unless MEGATRON_TEST_WARM=0."""
    import torch

    return (command[:2] == [sys.executable, PRETRAIN_SCRIPT] and os.environ.get("MEGATRON_TEST_WARM", "1") != "0"
            and not torch.cuda.is_available())


def _named_output() -> tempfile.NamedTemporaryFile:
    """A file for a job's output that its processes can open by name; removed when closed."""
    return tempfile.NamedTemporaryFile(mode="w+")


def run_together(specs: list[ProcessSpec], timeout: float = DEFAULT_TIMEOUT) -> list[RunResult]:
    """Start every process at once (each in its own session), wait for all; kill the rest on timeout."""
    started = []
    for spec in specs:
        output = _named_output()
        process = start_process(spec.command, subprocess_env(spec.env, spec.cpu_only), spec.cwd, output,
                                spec.cpu_only)
        started.append((spec, process, output))
    deadline = time.monotonic() + scaled_timeout(timeout)
    results = []
    for spec, process, output in started:
        timed_out = False
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_sessions([process])
            process.wait()
        output.seek(0)
        results.append(RunResult(spec.command, process.returncode, output.read(), timed_out))
        output.close()
    return results


def run_command(command: list[str], *, env: dict | None = None, timeout: float = DEFAULT_TIMEOUT,
                cwd: str = REPO_ROOT, cpu_only: bool = True) -> RunResult:
    """Run one command to completion (see run_together)."""
    return run_together([ProcessSpec(command, env or {}, cwd, cpu_only)], timeout)[0]


def script_directories() -> list[str]:
    """Where console scripts live: beside this Python, and the bin/ of a ``pip install --target`` DeepSpeed."""
    directories = [os.path.dirname(sys.executable)]
    spec = importlib.util.find_spec("deepspeed")
    if spec is not None and spec.origin:
        # <target>/deepspeed/__init__.py -> <target>/bin
        directories.append(os.path.join(os.path.dirname(os.path.dirname(spec.origin)), "bin"))
    return directories


def executable(name: str) -> str:
    """Path of a console script (torchrun, deepspeed) of this Python; skip the test when it is missing."""
    candidates = [os.path.join(directory, name) for directory in script_directories()]
    path = next((c for c in candidates if os.path.exists(c)), None) or shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed")
    return path


def torchrun_command(nproc: int) -> list[str]:
    """``torchrun --nproc_per_node N --master_addr 127.0.0.1 --master_port P`` on a free port P."""
    return [executable("torchrun"), "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port())]


def rank_variables(rank: int, nproc: int, port: int) -> dict:
    """What torchrun gives rank ``rank`` of a one-node job of ``nproc`` processes, less the variables of
    its agent (TORCHELASTIC_*): the trainer reads them as the plain-environment launcher ("env")."""
    size = str(nproc)
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "WORLD_SIZE": size, "LOCAL_WORLD_SIZE": size, "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": size,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def kill_sessions(processes: list[subprocess.Popen], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the session of every process still running (each leads its own)."""
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                pass


def stop_like_a_launcher(processes: list[subprocess.Popen], grace: float) -> None:
    """What torchrun does to the other ranks when one fails: SIGTERM, then SIGKILL after ``grace`` s."""
    kill_sessions(processes, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(process.poll() is None for process in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    kill_sessions(processes)


def wait_for_ranks(processes: list[subprocess.Popen], timeout: float) -> tuple[int, bool]:
    """(exit status, timed out) of a job: 0 when every rank succeeds, else the first failing rank's
    status, the others stopped then as torchrun stops them; every rank killed past ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        statuses = [process.poll() for process in processes]
        failed = [status for status in statuses if status not in (None, 0)]
        if failed:
            stop_like_a_launcher(processes, grace=scaled_timeout(RANK_STOP_GRACE))
            return failed[0], False
        if None not in statuses:
            return 0, False
        time.sleep(0.05)
    return -signal.SIGKILL, True


def run_ranks(command: list[str], nproc: int, *, env: dict | None = None,
              timeout: float = DEFAULT_TIMEOUT) -> RunResult:
    """``python command...`` as ``nproc`` ranks started directly, with the variables torchrun would set
    (rank_variables), their output in one stream as under torchrun: without torchrun's own start-up
    (seconds of a loaded machine) for tests that do not test the launcher. Each rank runs in its own
    session; whatever ends the job (success, a failing rank, the timeout, an exception here) leaves
    no rank running."""
    port = free_port()
    with _named_output() as output:
        processes = []
        try:
            for rank in range(nproc):
                processes.append(start_process(
                    [sys.executable, *command], subprocess_env({**(env or {}), **rank_variables(rank, nproc, port)}),
                    REPO_ROOT, output))
            status, timed_out = wait_for_ranks(processes, scaled_timeout(timeout))
        finally:
            kill_sessions(processes)
            for process in processes:
                process.wait()
        output.seek(0)
        return RunResult([f"ranks 0-{nproc - 1}: python", *command], status, output.read(), timed_out)


def run_script(command: list[str], nproc: int = 1, *, env: dict | None = None,
               timeout: float = DEFAULT_TIMEOUT) -> RunResult:
    """``python command...``: one plain process for nproc 1, else ``nproc`` ranks (run_ranks)."""
    if nproc == 1:
        return run_command([sys.executable, *command], env=env, timeout=timeout)
    return run_ranks(command, nproc, env=env, timeout=timeout)


def run_pretrain(flags: list[str], *, nproc: int = 1, env: dict | None = None,
                 timeout: float = DEFAULT_TIMEOUT) -> RunResult:
    """pretrain_gpt.py with ``flags`` on ``nproc`` processes (run_script)."""
    return run_script([PRETRAIN_SCRIPT, *flags], nproc, env=env, timeout=timeout)


class Job:
    """Processes started together in the background, their output in one file, for tests that act on
    a run while it runs (signals, kills); each process in its own session, killed with it."""

    def __init__(self, commands_and_envs, timeout: float = DEFAULT_TIMEOUT):
        self.timeout = scaled_timeout(timeout)
        self.output = tempfile.NamedTemporaryFile("w+", delete=False)
        self.processes = [start_process(command, subprocess_env(env), REPO_ROOT, self.output)
                          for command, env in commands_and_envs]

    def text(self) -> str:
        with open(self.output.name) as f:
            return f.read()

    def wait_for(self, pattern: str, alive=None) -> None:
        """Poll the output until ``pattern`` (a multiline regex) appears; kill the job and fail if it
        never does (the timeout passed, or nothing can print it any more: ``alive()`` is False, by
        default when every process of the job has ended)."""
        alive = alive or (lambda: any(p.poll() is None for p in self.processes))
        deadline = time.monotonic() + self.timeout
        while not re.search(pattern, self.text(), re.MULTILINE):
            if time.monotonic() > deadline or not alive():
                self.kill()
                raise AssertionError(f"never printed {pattern!r}:\n{self.text()[-4000:]}")
            time.sleep(0.05)

    def wait(self) -> list[int]:
        """The exit status of every process; kill the job and fail past the timeout."""
        deadline = time.monotonic() + self.timeout
        try:
            return [process.wait(timeout=max(0.0, deadline - time.monotonic())) for process in self.processes]
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the job did not stop:\n{self.text()[-4000:]}") from None

    def kill(self) -> None:
        """SIGKILL every process's session, then reap them."""
        kill_sessions(self.processes)
        for process in self.processes:
            process.wait()


def start_ranks(flags: list[str], nproc: int = 2, timeout: float = DEFAULT_TIMEOUT) -> Job:
    """pretrain_gpt.py as ``nproc`` plain processes with RANK, WORLD_SIZE, ... set (the "env" launcher)."""
    base = {"WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    return Job([([sys.executable, PRETRAIN_SCRIPT, *flags], {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)})
                for rank in range(nproc)], timeout)


# ---------------------------------------------------------------------------------------- reading logs

# The trainer's lines are read by megatron.training.log_reader; these keep the tests' names and shapes.
LogLine = IterationRecord


def parse_log_lines(output: str) -> list[LogLine]:
    """Every per-iteration line of ``output`` (launcher prefixes such as ``[default0]:`` are skipped over)."""
    return iteration_records(output)


def parse_validation_lines(output: str) -> list[tuple[str, float, float]]:
    """(prefix, loss, ppl) of every ``... loss at ... | lm loss value: X | lm loss PPL: Y |`` line."""
    return [(record.prefix, record.loss, record.ppl) for record in validation_records(output)]


def read_scalars(log_dir: str) -> dict:
    """{tag: [(step, value), ...]} of every scalar in the TensorBoard event files under ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
        raise AssertionError(f"no TensorBoard event file in {log_dir}")
    accumulator = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


# ---------------------------------------------------------------------------------------- processes


def processes_with_argument(text: str) -> list[int]:
    """Pids of the running processes (zombies left out) one of whose command-line arguments contains
    ``text``: a test's unique temporary path finds every process of its job, wherever the launcher
    put it (other sessions, re-parented to init)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                arguments = f.read().split(b"\0")
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(text.encode() in argument for argument in arguments):
            found.append(int(name))
    return found


def wait_until_no_process_with(text: str, timeout: float) -> float:
    """Seconds until no process has ``text`` in its command line (processes_with_argument); past
    ``timeout`` every such process is killed and the test fails."""
    start = time.monotonic()
    while processes_with_argument(text):
        if time.monotonic() - start > timeout:
            left = processes_with_argument(text)
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            raise AssertionError(f"processes {left} still ran {timeout:.0f} s later (killed now)")
        time.sleep(0.1)
    return time.monotonic() - start
