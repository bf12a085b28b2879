"""Named wall-clock timers, as Megatron's: start/stop accumulate, elapsed reads (and resets).

On GPU every start and stop synchronizes the current CUDA device first, so a timer measures the
kernels launched inside it rather than the launch overhead.
"""
import time
from typing import Iterable

import torch


class TimerError(RuntimeError):
    """A timer started twice or stopped while not running."""


class Timer:
    """Accumulates the seconds between start() and stop() calls."""

    def __init__(self, name: str, synchronize: bool):
        self.name = name
        self._synchronize = synchronize
        self._elapsed = 0.0
        self._started_at = None

    @property
    def running(self) -> bool:
        return self._started_at is not None

    def _now(self) -> float:
        if self._synchronize:
            torch.cuda.synchronize()
        return time.perf_counter()

    def start(self):
        if self.running:
            raise TimerError(f"timer {self.name!r} has already been started")
        self._started_at = self._now()

    def stop(self):
        if not self.running:
            raise TimerError(f"timer {self.name!r} is not started")
        self._elapsed += self._now() - self._started_at
        self._started_at = None

    def reset(self):
        self._elapsed = 0.0
        self._started_at = None

    def elapsed(self, reset: bool = True) -> float:
        """Accumulated seconds, including the running interval; a running timer keeps running."""
        was_running = self.running
        if was_running:
            self.stop()
        seconds = self._elapsed
        if reset:
            self.reset()
        if was_running:
            self.start()
        return seconds


class Timers:
    """A registry of Timers created on first use: ``timers("forward-compute").start()``.

    ``synchronize`` defaults to whether CUDA is available.
    """

    def __init__(self, synchronize: bool | None = None):
        self.synchronize = torch.cuda.is_available() if synchronize is None else synchronize
        self.timers: dict[str, Timer] = {}

    def __call__(self, name: str) -> Timer:
        if name not in self.timers:
            self.timers[name] = Timer(name, self.synchronize)
        return self.timers[name]

    def __contains__(self, name: str) -> bool:
        return name in self.timers

    def existing(self, names: Iterable[str]) -> list[str]:
        """The names among ``names`` that have a timer, in order (Megatron-DeepSpeed logs only those)."""
        return [name for name in names if name in self.timers]

    def elapsed_seconds(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        """{name: elapsed seconds / normalizer} for each named timer."""
        if normalizer <= 0.0:
            raise ValueError(f"timer normalizer must be > 0, got {normalizer}")
        return {name: self.timers[name].elapsed(reset=reset) / normalizer for name in names}

    def log_line(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> str:
        """``time (ms) | name: x.xx | ...``: milliseconds per ``normalizer`` (e.g. per iteration)."""
        seconds = self.elapsed_seconds(names, normalizer, reset)
        return "time (ms)" + "".join(f" | {name}: {value * 1000.0:.2f}" for name, value in seconds.items())

    def write(self, names: Iterable[str], tensorboard, iteration: int, normalizer: float = 1.0,
              reset: bool = False):
        """Write ``time/{name}-time`` (seconds per ``normalizer``) through a TensorBoardLogger."""
        tensorboard.write_timers(iteration, self.elapsed_seconds(names, normalizer, reset))

