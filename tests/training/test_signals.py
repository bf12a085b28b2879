"""Stopping without loss: SIGTERM, SIGINT and SIGUSR1 mid-run save a checkpoint at the current iteration,
and the resumed run continues exactly as if nothing had happened (dropout 0.1, losses equal to the bit).

Each signal is sent two ways, as clusters and users send them:
  to one rank        the ranks are started as plain processes (RANK, WORLD_SIZE, ... in their
                     environment) and one of them gets the signal; every rank must exit 0
  to the launcher    torchrun gets SIGTERM or SIGINT and passes it on to its workers; SIGUSR1 goes to
                     every process of the job, as SLURM's --signal does (torchrun has no handler for
                     it and exits at once; the ranks save)
A second signal while the checkpoint is written must not spoil it.
"""
import os
import re
import signal
import subprocess
import time

import pytest

from megatron.training.signals import EXIT_SIGNALS, ExitSignals
from tests.training.e2e_utils import (PRETRAIN_SCRIPT, Job, read_scalars, run_pretrain, start_ranks, tiny_gpt_flags,
                                      torchrun_command)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TRAIN_ITERS = 60
FLAGS = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(TRAIN_ITERS), "--lr", "1e-3",
         "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1", "--save-interval", "1000"]
STOP_LINE = re.compile(r"received (SIG\w+): saved a checkpoint at iteration (\d+) in (\S+); resume with the same "
                       r"command and --load (\S+)")
TIMEOUT = 600


def run_flags(data, tmp_path, name):
    flags = tiny_gpt_flags(data) + FLAGS + ["--tensorboard-dir", str(tmp_path / name / "tb"),
                                            "--save", str(tmp_path / "ckpt")]
    flags[flags.index("--num-workers") + 1] = "1"
    return flags


def training_losses(tensorboard_dir):
    return dict(read_scalars(tensorboard_dir)["lm-loss-training/lm loss"])


@pytest.fixture(scope="module")
def reference(e2e_data, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("reference")
    run_pretrain(run_flags(e2e_data, tmp_path, "run"), nproc=2, timeout=TIMEOUT).assert_ok()
    losses = training_losses(str(tmp_path / "run" / "tb"))
    assert sorted(losses) == list(range(1, TRAIN_ITERS + 1))
    return losses


def start_torchrun(flags) -> Job:
    return Job([(torchrun_command(2) + [PRETRAIN_SCRIPT, *flags], {})], TIMEOUT)


def every_process_of(job: Job) -> list[int]:
    """The job's processes and all their descendants (ranks, DataLoader workers): what SLURM signals,
    since it tracks a job step's processes, not their sessions (torchrun starts each rank in its own)."""
    output = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    children = {}
    for pid, parent in (map(int, line.split()) for line in output.splitlines()):
        children.setdefault(parent, []).append(pid)
    found, pending = [], [process.pid for process in job.processes]
    while pending:
        pid = pending.pop()
        found.append(pid)
        pending += children.get(pid, [])
    return found


def wait_until_gone(pids, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while any(_running(pid) for pid in pids):
        assert time.monotonic() < deadline, f"processes {pids} still run"
        time.sleep(0.1)


def _running(pid) -> bool:
    return os.path.exists(f"/proc/{pid}") and "zombie" not in _state(pid)


def _kill(pid) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _state(pid) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((line for line in f if line.startswith("State:")), "").lower()
    except OSError:
        return "zombie"


CASES = [("SIGTERM", "rank"), ("SIGINT", "rank"), ("SIGUSR1", "rank"),
         ("SIGTERM", "launcher"), ("SIGINT", "launcher"), ("SIGUSR1", "launcher")]


@pytest.mark.parametrize("name, target", CASES)
def test_signal_saves_and_the_resumed_run_continues_exactly(e2e_data, tmp_path, reference, name, target):
    number = getattr(signal, name)
    flags = run_flags(e2e_data, tmp_path, "stopped")
    job = start_ranks(flags, timeout=TIMEOUT) if target == "rank" else start_torchrun(flags)
    job.wait_for(r"^ iteration +3/")
    ranks_alive = None
    if target == "rank":
        os.kill(job.processes[1].pid, number)
    elif name == "SIGUSR1":
        signalled = every_process_of(job)
        for pid in signalled:
            os.kill(pid, number)
        ranks_alive = lambda: any(_running(pid) for pid in signalled)  # noqa: E731 - torchrun is gone at once
    else:
        os.kill(job.processes[0].pid, number)
    try:
        job.wait_for(r"^saving checkpoint at iteration", alive=ranks_alive)
    except AssertionError:
        if ranks_alive:  # torchrun's ranks run in sessions of their own, beyond Job.kill
            for pid in signalled:
                _kill(pid)
        raise
    for process in job.processes[-1:] if target == "rank" else []:
        os.kill(process.pid, number)  # a second signal while the checkpoint is written
    codes = job.wait()
    if target == "launcher" and name == "SIGUSR1":
        wait_until_gone(signalled)  # torchrun died of the signal at once; its ranks go on saving
    output = job.text()
    if target == "rank":
        assert codes == [0, 0], output[-4000:]
    assert "Unable to shutdown process" not in output, "a worker outlived the launcher's grace period"
    stop = STOP_LINE.search(output)
    assert stop is not None, output[-4000:]
    iteration = int(stop[2])
    assert stop[1] == name and stop[3] == stop[4] == str(tmp_path / "ckpt") and 3 <= iteration < TRAIN_ITERS
    assert (tmp_path / "ckpt" / "latest").read_text() == f"global_step{iteration}"

    resumed = run_pretrain(run_flags(e2e_data, tmp_path, "resumed") + ["--load", str(tmp_path / "ckpt")], nproc=2,
                           timeout=TIMEOUT)
    resumed.assert_ok()
    assert f"successfully loaded checkpoint from {tmp_path / 'ckpt'} at iteration {iteration}" in resumed.output
    losses = training_losses(str(tmp_path / "resumed" / "tb"))
    assert sorted(losses) == list(range(iteration + 1, TRAIN_ITERS + 1))
    assert {it: losses[it] for it in losses} == {it: reference[it] for it in losses}  # difference 0.0


@pytest.fixture
def saved_exit_handlers():
    saved = {number: signal.getsignal(number) for number in EXIT_SIGNALS}
    yield
    for number, handler in saved.items():
        signal.signal(number, handler)


def test_after_a_signal_further_ones_stay_ignored_until_the_process_exits(saved_exit_handlers):
    with ExitSignals() as signals:
        os.kill(os.getpid(), signal.SIGUSR1)
    assert signals.first == signal.SIGUSR1
    assert [signal.getsignal(number) for number in EXIT_SIGNALS] == [signal.SIG_IGN] * len(EXIT_SIGNALS)
    os.kill(os.getpid(), signal.SIGUSR1)  # would end this process under the default handler


def test_without_a_signal_the_previous_handlers_come_back(saved_exit_handlers):
    def handler(number, frame):
        pass

    signal.signal(signal.SIGUSR1, handler)
    with ExitSignals() as signals:
        assert signal.getsignal(signal.SIGUSR1) != handler
    assert signals.first == 0 and signal.getsignal(signal.SIGUSR1) is handler
