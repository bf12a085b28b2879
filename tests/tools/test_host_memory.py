"""tools/benchmarks/host_memory.py: a run's processes and the memory they hold once."""
import os
import re
import subprocess
import sys
import time

import pytest

from megatron.training.signals import process_parent
from tools.benchmarks.host_memory import main, proportional_kib, run_memory_mb, run_processes

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux's /proc")

# A parent holding 256 MiB that forks a child: the child maps the same pages (copy-on-write).
FORKING_HOLDER = """
import os, sys, time
ballast = bytearray(256 << 20)
for i in range(0, len(ballast), 4096):
    ballast[i] = 1
if os.fork() == 0:
    time.sleep(60)
    os._exit(0)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def forking_run(tmp_path):
    marker = str(tmp_path / "run-marker")
    process = subprocess.Popen([sys.executable, "-c", FORKING_HOLDER, marker], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        yield marker, process
    finally:
        os.killpg(process.pid, 9)
        process.wait()


def _resident_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_a_run_is_its_marked_processes_and_their_descendants(forking_run):
    marker, process = forking_run
    deadline = time.time() + 10
    while len(found := run_processes(marker)) < 2 and time.time() < deadline:
        time.sleep(0.1)
    (child,) = found - {process.pid}
    assert process.pid in found and process_parent(child) == process.pid
    assert run_processes(marker, exclude=process.pid) == set()  # the caller and what it started left out
    assert run_processes(marker + "-other") == set()


def test_shared_pages_count_once(forking_run):
    marker, process = forking_run
    pids = run_processes(marker)
    resident_mib = sum(_resident_kib(pid) for pid in pids) / 1024
    mb, count, proportional = run_memory_mb(marker)
    assert count == 2 and proportional
    assert resident_mib > 2 * 256  # each process's resident size holds the ballast
    assert 256 < mb < 256 + 128  # held once, with the two interpreters
    assert all(proportional_kib(pid)[1] for pid in pids)


def test_the_command_follows_the_run_and_writes_its_peak(forking_run, tmp_path):
    marker, process = forking_run
    output = tmp_path / "peak.txt"
    reader = subprocess.Popen([sys.executable, "-m", "tools.benchmarks.host_memory", marker, "--every", "0.2",
                               "--output", str(output)], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        first = reader.stdout.readline()
        os.killpg(process.pid, 9)  # the run ends: the command ends after its next reading
        assert reader.wait(timeout=30) == 0
    finally:
        reader.kill()
    assert re.fullmatch(r"\d+ MB in 2 processes at \d\d:\d\d:\d\d\n", first)
    assert 256 < int(first.split()[0]) < 256 + 128
    assert output.read_text().startswith("host peak (MB): ")


@pytest.mark.parametrize("flags, message", [([" "], "MARKER must not be empty"),
                                            (["x", "--every", "0"], "--every must be positive")])
def test_bad_arguments_are_named(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
