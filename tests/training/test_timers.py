"""Timers: accumulation, elapsed with and without reset, the log line, misuse errors, CUDA sync."""
import re

import pytest
import torch

from megatron.training import timers as timers_module
from megatron.training.timers import TimerError, Timers


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(timers_module.time, "perf_counter", fake)
    return fake


def test_start_stop_accumulates_and_elapsed_resets(clock):
    timers = Timers(synchronize=False)
    timer = timers("forward-compute")
    timer.start()
    clock.now += 0.5
    timer.stop()
    timer.start()
    clock.now += 0.25
    timer.stop()
    assert timer.elapsed(reset=False) == pytest.approx(0.75)
    assert timer.elapsed() == pytest.approx(0.75)
    assert timer.elapsed() == 0.0


def test_elapsed_of_a_running_timer_keeps_it_running(clock):
    timer = Timers(synchronize=False)("interval-time")
    timer.start()
    clock.now += 2.0
    assert timer.elapsed() == pytest.approx(2.0)
    assert timer.running
    clock.now += 1.0
    assert timer.elapsed() == pytest.approx(1.0)


def test_log_line_format_and_normalizer(clock):
    timers = Timers(synchronize=False)
    for name, seconds in (("forward-compute", 0.30), ("optimizer", 0.0129)):
        timers(name).start()
        clock.now += seconds
        timers(name).stop()
    assert timers.existing(["batch-generator", "optimizer", "forward-compute"]) == ["optimizer", "forward-compute"]
    line = timers.log_line(["forward-compute", "optimizer"], normalizer=3)
    assert line == "time (ms) | forward-compute: 100.00 | optimizer: 4.30"
    assert re.fullmatch(r"time \(ms\)( \| [a-z-]+: \d+\.\d{2})+", line)
    assert timers.log_line(["forward-compute"]) == "time (ms) | forward-compute: 0.00"  # reset by the first log


def test_misuse_raises():
    timers = Timers(synchronize=False)
    with pytest.raises(TimerError, match="'x' is not started"):
        timers("x").stop()
    timers("x").start()
    with pytest.raises(TimerError, match="'x' has already been started"):
        timers("x").start()
    with pytest.raises(ValueError, match="normalizer"):
        timers.log_line(["x"], normalizer=0)


def test_synchronizes_cuda_when_asked(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: calls.append(args))
    timers = Timers(synchronize=True)
    timers("step").start()
    timers("step").stop()
    assert len(calls) == 2
    assert Timers().synchronize == torch.cuda.is_available()


@pytest.mark.gpu
def test_cuda_timer_measures_the_kernels():
    timers = Timers()
    a = torch.randn(4096, 4096, device="cuda")
    timers("matmul").start()
    for _ in range(10):
        a @ a
    timers("matmul").stop()
    assert timers("matmul").elapsed() > 1e-4
