"""The test harness itself: a command that outruns its timeout is killed with every process it
started, and timeouts scale with MEGATRON_TEST_TIMEOUT_SCALE."""
import os
import time

import pytest

from tests.training.e2e_utils import run_command, scaled_timeout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"  # a zombie is dead, only not yet reaped by its parent


def test_a_timed_out_command_is_killed_with_its_grandchildren():
    started = time.monotonic()
    result = run_command(["bash", "-c", "sleep 600 & echo $!; wait"], timeout=2)
    assert result.timed_out and time.monotonic() - started < 60
    grandchild = int(result.output.split()[0])
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild), "the sleep that bash started outlived the timeout"


def test_timeouts_scale_with_the_environment(monkeypatch):
    monkeypatch.setenv("MEGATRON_TEST_TIMEOUT_SCALE", "2.5")
    assert scaled_timeout(100) == 250
    monkeypatch.delenv("MEGATRON_TEST_TIMEOUT_SCALE")
    assert scaled_timeout(100) == 100
    monkeypatch.setenv("MEGATRON_TEST_TIMEOUT_SCALE", "fast")
    with pytest.raises(ValueError, match="MEGATRON_TEST_TIMEOUT_SCALE='fast'"):
        scaled_timeout(100)
