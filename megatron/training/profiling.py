"""Profiling chosen iterations of a run, with Megatron-LM's flags.

    --profile --use-pytorch-profiler --profile-step-start A --profile-step-end B [--profile-ranks R ...]

This profiles iterations A+1 .. B in the log's numbering. As in Megatron-LM, recording starts before
the step that follows iteration A and stops after iteration B. It runs on the listed global ranks
(rank 0 by default).

torch.profiler records the CPU activity and, on a GPU, the CUDA kernels. Each iteration is a range
named ``iteration N``. When iteration B ends, each profiled rank writes two files into
--tensorboard-dir:
- ``profile_rank{R}_iterations_{A+1}-{B}.pt.trace.json``: the trace, for Perfetto, chrome://tracing
  or TensorBoard's profiler plugin;
- ``profile_rank{R}_iterations_{A+1}-{B}.txt``: the operators sorted by self time on the device,
  or on the CPU without a GPU.

A run that ends or stops inside the window writes what it recorded, named by the iterations it
covered. The profiled iterations run slower, and their log lines show it.
"""
import contextlib
import os
from collections.abc import Iterator

import torch

from megatron.training import dist_utils
from megatron.training.config import ProfileConfig

TABLE_ROWS = 40


class IterationProfiler:
    """Wraps each training iteration (``with profiler.iteration(n):``) and records those in the window."""

    def __init__(self, config: ProfileConfig, rank: int, device: torch.device):
        self.config, self.rank, self.device = config, rank, device
        self.records = config.enabled and rank in config.ranks
        self.profile: torch.profiler.profile | None = None
        self.first_recorded = self.last_recorded = None

    def _in_window(self, iteration: int) -> bool:
        return self.records and self.config.step_start < iteration <= self.config.step_end

    @contextlib.contextmanager
    def iteration(self, iteration: int) -> Iterator[None]:
        """Run iteration ``iteration`` (1-based, the number its log line will carry)."""
        if not self._in_window(iteration):
            yield
            return
        if self.profile is None:
            self._start(iteration)
        with torch.profiler.record_function(f"iteration {iteration}"):
            yield
        self.last_recorded = iteration
        if iteration == self.config.step_end:
            self.close()

    def _start(self, iteration: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # without the operators' input shapes: recording them slows the host further, and a run whose
        # host is barely ahead of its GPUs (TP) would show the profiler's idle rather than its own
        self.profile = torch.profiler.profile(activities=activities, record_shapes=False)
        self.profile.start()
        self.first_recorded = iteration
        dist_utils.print_line(f"[rank {self.rank}] profiling iterations {iteration}-{self.config.step_end}")

    def close(self) -> None:
        """Stop recording and write the files; nothing when nothing was recorded."""
        if self.profile is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.profile.stop()
        profile, self.profile = self.profile, None
        if self.last_recorded is None:
            return
        stem = os.path.join(self.config.directory,
                            f"profile_rank{self.rank}_iterations_{self.first_recorded}-{self.last_recorded}")
        os.makedirs(self.config.directory, exist_ok=True)
        profile.export_chrome_trace(stem + ".pt.trace.json")
        sort_by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        with open(stem + ".txt", "w") as f:
            f.write(f"rank {self.rank}, iterations {self.first_recorded}-{self.last_recorded}, sorted by {sort_by}\n")
            f.write(profile.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS) + "\n")
        dist_utils.print_line(f"[rank {self.rank}] profile of iterations {self.first_recorded}-{self.last_recorded}: "
                              f"{stem}.pt.trace.json, {stem}.txt")
