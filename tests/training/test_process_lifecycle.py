"""How a job of several ranks ends when one part of it goes away, end to end on CPU with 2 gloo ranks.

    one rank fails (in set-up after the data loaders exist, or on a damaged optimizer shard)
        every rank ends within seconds: the failed rank with its error, the others with one line
        each, no gloo traceback, no DataLoader worker left; the last checkpoint stays intact
    every rank meets the same error
        it is printed once, by the first rank to meet it
    the launcher alone is killed (``kill`` of the deepspeed runner, SIGKILL of the torchrun agent)
        the ranks notice at the next iteration boundary, save that iteration, say so, exit; no
        process of the job is left a minute later (and under the deepspeed launcher, which sets no
        thread count, the ranks share the CPUs: one line says how)

The ranks of the first kind start as plain processes (start_ranks) that nobody stops: a rank ending
by itself is what is tested, not a launcher stopping it.
"""
import os
import re
import shutil
import signal
import sys
import time

import pytest

from megatron.training.signals import LauncherWatch, launcher_name
from tests.dist_utils import free_port
from tests.training.e2e_utils import (PRETRAIN_SCRIPT, REPO_ROOT, Job, executable, processes_with_argument,
                                      run_pretrain, scaled_timeout, start_ranks, tiny_gpt_flags, torchrun_command,
                                      wait_until_no_process_with)

FAIL_SCRIPT = os.path.join(REPO_ROOT, "tests", "training", "fail_on_rank.py")
FLAGS = ["--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--log-interval", "1",
         "--eval-interval", "1000", "--eval-iters", "1"]
LOST_PEER_LINE = re.compile(r"^pretrain_gpt\.py: rank 0 stops: another rank of the job has ended", re.MULTILINE)
# After the first rank ends, how long the others may take (they ended only by a 600 s gloo timeout before).
END_WITHIN = 20


def flags_with_workers(data, tmp_path, train_iters):
    flags = tiny_gpt_flags(data) + FLAGS + ["--train-iters", str(train_iters), "--save", str(tmp_path / "ckpt"),
                                            "--tensorboard-dir", str(tmp_path / "tb")]
    # Persistent workers in every loader: they ignore SIGTERM, which once hung the failed rank's exit.
    flags[flags.index("--num-workers") + 1] = "1"
    flags[flags.index("--valid-num-workers") + 1] = "1"
    return flags


def start_failing_ranks(flags, fail_env) -> Job:
    base = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **fail_env}
    return Job([([sys.executable, FAIL_SCRIPT, *flags], {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)})
                for rank in range(2)])


def wait_for_every_rank(job: Job) -> tuple[list[int], float]:
    """(exit statuses, seconds between the first rank's end and the last's)."""
    ended = {}
    deadline = time.monotonic() + job.timeout
    while len(ended) < len(job.processes):
        for index, process in enumerate(job.processes):
            if index not in ended and process.poll() is not None:
                ended[index] = time.monotonic()
        if time.monotonic() > deadline:
            job.kill()
            raise AssertionError(f"the job did not end:\n{job.text()[-4000:]}")
        time.sleep(0.05)
    return [process.returncode for process in job.processes], max(ended.values()) - min(ended.values())


@pytest.mark.slow
@pytest.mark.distributed
def test_one_rank_failing_in_set_up_ends_every_rank_with_its_error_shown_once(e2e_data, tmp_path):
    """Rank 1 raises while the trainer opens TensorBoard, its loaders' workers already running (their
    exit hung the rank for good); rank 0, waiting in a collective, stops too."""
    job = start_failing_ranks(flags_with_workers(e2e_data, tmp_path, 6) + ["--save-interval", "1000"],
                              {"FAIL_RANK": "1"})
    try:
        statuses, spread = wait_for_every_rank(job)
    finally:
        job.kill()
    output = job.text()
    assert statuses == [1, 1], output[-4000:]
    assert spread < scaled_timeout(END_WITHIN), f"rank 0 ended {spread:.0f} s after rank 1:\n{output[-4000:]}"
    injected = "FileNotFoundError: [Errno 2] No such file or directory: '/injected/tensorboard'"
    assert output.count(injected) == 1 and output.count("Traceback (most recent call last)") == 1, output[-4000:]
    assert len(LOST_PEER_LINE.findall(output)) == 1, output[-4000:]
    assert "Connection closed by peer" not in output and "pair.cc" not in output, output[-4000:]
    assert not processes_with_argument(str(tmp_path)), "a DataLoader worker outlived its rank"
    assert not (tmp_path / "ckpt").exists()


@pytest.fixture(scope="module")
def zero1_checkpoint(e2e_data, tmp_path_factory):
    """(flags, directory) of a 2-rank TP=2 ZeRO-1 run saved at iteration 2: one optimizer shard per rank.

    Its console has one memory line for both ranks, and no per-rank line of DeepSpeed's start."""
    directory = tmp_path_factory.mktemp("zero1") / "ckpt"
    flags = tiny_gpt_flags(e2e_data) + FLAGS + ["--train-iters", "2", "--zero-stage", "1", "--save-interval", "2",
                                                "--tensor-model-parallel-size", "2"]
    result = run_pretrain(flags + ["--save", str(directory)], nproc=2)
    result.assert_ok()
    memory = re.findall(r"^\[Rank (\d)\] \(after 1 iterations\) memory \(MB\) \| max resident: [\d.]+ \| the largest "
                        r"of 2 ranks$", result.output, re.MULTILINE)
    assert len(memory) == 1 and result.output.count("memory (MB)") == 1, result.output[-4000:]
    assert "built successfully" not in result.output
    return flags, directory


def resume_from_a_copy(zero1_checkpoint, tmp_path, damage, extra_flags):
    flags, saved = zero1_checkpoint
    directory = tmp_path / "ckpt"
    shutil.copytree(saved, directory)
    damage(directory / "global_step2")
    job = start_ranks(flags + extra_flags + ["--load", str(directory), "--save", str(directory)])
    try:
        statuses, spread = wait_for_every_rank(job)
    finally:
        job.kill()
    return statuses, spread, job.text(), directory


def error_lines(output):
    return [line for line in output.splitlines() if "pretrain_gpt.py: error:" in line]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_damaged_optimizer_shard_of_one_rank_is_one_error_and_one_status(zero1_checkpoint, tmp_path):
    """Rank 1 alone reads a damaged shard: its error, and rank 0's one line (no gloo traceback)."""
    shard = "zero_pp_rank_0_mp_rank_01_optim_states.pt"  # tensor-parallel rank 1's

    def damage(step_directory):
        raw = bytearray((step_directory / shard).read_bytes())
        raw[len(raw) // 2:len(raw) // 2 + 64] = bytes(64)
        (step_directory / shard).write_bytes(bytes(raw))

    statuses, spread, output, directory = resume_from_a_copy(zero1_checkpoint, tmp_path, damage, [])
    assert statuses == [1, 1] and spread < scaled_timeout(END_WITHIN), (statuses, spread, output[-4000:])
    errors = error_lines(output)
    assert len(errors) == 1 and shard in errors[0], output[-4000:]
    assert len(LOST_PEER_LINE.findall(output)) == 1 and "Traceback" not in output, output[-4000:]
    assert "Connection closed by peer" not in output
    assert (directory / "latest").read_text() == "global_step2"


@pytest.mark.slow
@pytest.mark.distributed
def test_an_error_every_rank_meets_is_shown_once(zero1_checkpoint, tmp_path):
    """Both ranks find the checkpoint's learning-rate schedule unlike the configured one (a longer run)."""
    statuses, spread, output, directory = resume_from_a_copy(zero1_checkpoint, tmp_path, lambda step: None,
                                                             ["--train-iters", "4"])
    assert statuses == [1, 1] and spread < scaled_timeout(END_WITHIN), (statuses, spread, output[-4000:])
    errors = error_lines(output)
    assert len(errors) == 1 and "learning-rate schedule differs" in errors[0], output[-4000:]
    assert "Traceback" not in output and not LOST_PEER_LINE.search(output), output[-4000:]
    assert (directory / "latest").read_text() == "global_step2"


def launch_command(launcher: str, flags: list[str]) -> list[str]:
    if launcher == "deepspeed":
        return [executable("deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), PRETRAIN_SCRIPT,
                *flags]
    return torchrun_command(2) + [PRETRAIN_SCRIPT, *flags]


STOP_LINE = re.compile(r"^the (\S+) launcher \(pid (\d+)\) has ended: saved a checkpoint at iteration (\d+) in (\S+); "
                       r"resume with the same command and --load (\S+)$", re.MULTILINE)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("launcher, sig", [("deepspeed", signal.SIGTERM), ("torchrun", signal.SIGKILL)])
def test_ranks_whose_launcher_is_killed_save_and_exit(e2e_data, tmp_path, launcher, sig):
    """``kill PID`` of the deepspeed runner ends it alone (it forwards signals only to pdsh jobs), and
    a torchrun agent killed by SIGKILL forwards nothing: the ranks must stop by themselves."""
    flags = flags_with_workers(e2e_data, tmp_path, 100000) + ["--save-interval", "100000"]
    job = Job([(launch_command(launcher, flags), {"OMP_NUM_THREADS": ""})], timeout=300)
    try:
        job.wait_for(r"^ iteration +3/")
        os.kill(job.processes[0].pid, sig)
        assert job.wait() == [-sig]
        seconds = wait_until_no_process_with(str(tmp_path), scaled_timeout(60))
    finally:
        job.kill()
        for pid in processes_with_argument(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)
    output = job.text()
    stop = STOP_LINE.search(output)
    assert stop is not None, output[-4000:]
    name, pid, iteration = stop[1], int(stop[2]), int(stop[3])
    assert (name, pid) == (launcher, job.processes[0].pid), stop[0]
    assert stop[4] == stop[5] == str(tmp_path / "ckpt")
    logged = [int(number) for number in re.findall(r"^ iteration +(\d+)/", output, re.MULTILINE)]
    assert 3 <= iteration == max(logged), (iteration, logged[-3:])  # the iteration it stopped at, nothing after
    assert (tmp_path / "ckpt" / "latest").read_text() == f"global_step{iteration}"
    assert "Traceback" not in output, output[-4000:]
    if launcher == "deepspeed":  # which sets no thread count (torchrun sets OMP_NUM_THREADS=1)
        threads = max(1, len(os.sched_getaffinity(0)) // 2)
        assert output.count(f"> OMP_NUM_THREADS is not set: {threads} CPU thread(s) per process (2 processes on "
                            f"this node)") == 1, output[-4000:]
    print(f"{launcher}: every process gone {seconds:.1f} s after the kill")


# ---------------------------------------------------------------------------------------- LauncherWatch


def fake_tree(parents: dict[int, int], commands: dict[int, str]):
    """parent_of and command_of over a process table held in two dicts (edited by the test)."""
    return (lambda pid: parents.get(pid)), (lambda pid: commands.get(pid, "bash").split())


def test_the_watch_remembers_the_launchers_above_this_process(monkeypatch):
    parents = {500: 400, 400: 300, 300: 1}
    commands = {500: "python -u -m deepspeed.launcher.launch --world_info=e30=",
                400: "python /venv/bin/deepspeed --num_gpus 2 pretrain_gpt.py", 300: "bash job.sh"}
    monkeypatch.setattr(os, "getppid", lambda: 500)
    watch = LauncherWatch(*fake_tree(parents, commands))
    assert watch.chain == [(500, "deepspeed.launcher.launch"), (400, "deepspeed")]
    assert not watch.gone()
    parents[300] = 1  # the shell above the runner ending is not the launcher ending (nohup deepspeed ...)
    assert not watch.gone()
    parents[500] = 1  # the runner is killed: its child goes to init
    assert watch.gone() and watch.description() == "the deepspeed launcher (pid 400) has ended"
    parents[500] = 400
    assert watch.gone(), "once gone, a launcher stays gone"


def test_the_watch_sees_its_own_parent_end(monkeypatch):
    parent = [700]
    monkeypatch.setattr(os, "getppid", lambda: parent[0])
    watch = LauncherWatch(*fake_tree({700: 650}, {700: "/venv/bin/python /venv/bin/torchrun --nproc_per_node 2 x"}))
    assert watch.chain == [(700, "torchrun")] and not watch.gone()
    parent[0] = 1
    assert watch.gone() and watch.description() == "the torchrun launcher (pid 700) has ended"


def test_without_a_launcher_nothing_is_watched(monkeypatch):
    monkeypatch.setattr(os, "getppid", lambda: 800)
    watch = LauncherWatch(*fake_tree({800: 1}, {800: "bash -c python pretrain_gpt.py"}))
    assert watch.chain == [] and not watch.gone()


def test_launcher_names():
    assert launcher_name(["/usr/bin/python3", "-m", "torch.distributed.run", "x.py"]) == "torch.distributed.run"
    assert launcher_name(["python", "-m", "torch.distributed.launch"]) == "torch.distributed.launch"
    assert launcher_name(["/opt/bin/torchrun", "--nproc_per_node", "8"]) == "torchrun"
    assert launcher_name(["python", "pretrain_gpt.py", "--deepspeed"]) is None
    assert launcher_name(["slurmstepd: [42.0]"]) is None and launcher_name([]) is None


def test_the_watch_of_this_process_reads_the_real_process_table():
    """pytest's parent is no launcher, and the /proc readers agree with os.getppid."""
    from megatron.training.signals import process_parent

    assert process_parent(os.getpid()) == os.getppid()
    assert process_parent(2 ** 22 + 1) is None  # beyond pid_max: no such process
    assert not LauncherWatch().gone()


def test_a_lost_peer_is_told_from_other_errors():
    from megatron.training.dist_utils import first_to_report, peer_lost

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:22193. GLHF!")
    assert peer_lost(gloo) and peer_lost(RuntimeError("Connection reset by peer"))
    try:
        try:
            raise gloo
        except RuntimeError as error:
            raise ValueError("while saving") from error
    except ValueError as wrapped:
        assert peer_lost(wrapped)  # the cause decides
    assert not peer_lost(RuntimeError("injected failure")) and not peer_lost(OSError("Connection closed by peer"))
    assert first_to_report("any message")  # one process without a process group: always its own report
