"""A step of fixed shapes captured once as a CUDA graph and replayed.

A decode step of a 1.3B model is a few hundred small kernels; at batch 1 launching them from Python
costs more than the GPU takes to run them. Captured once, the step is one graph launch. The step
must read its inputs from, and write its output to, the same tensors on every call (the captured
addresses), hold no host-side value that changes (positions live in device tensors), and synchronize
nothing with the host. Capture runs the step on a side stream first (allocations, kernel
compilation), as torch.cuda.graph requires; the first step is thereby run three times, which is
harmless when it only writes what it would write anyway (a cache entry of the same position).
"""
from collections.abc import Callable

import torch

WARMUP_RUNS = 2


class CapturedStep:
    """``step(inputs) -> output`` captured for inputs shaped like ``example``; call it with new inputs."""

    def __init__(self, step: Callable[[torch.Tensor], torch.Tensor], example: torch.Tensor):
        self.inputs = example.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                step(self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = step(self.inputs)

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        self.inputs.copy_(inputs)
        self.graph.replay()
        return self.output.clone()
