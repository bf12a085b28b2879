"""Host-side launch arithmetic of the Triton kernels."""
import math

import torch

from megatron.core.fused_kernels import launch


def test_cdiv_and_next_power_of_2_match_their_definitions():
    for n in range(1, 3000):
        assert launch.next_power_of_2(n) == 2 ** math.ceil(math.log2(n))
        for d in (1, 3, 4, 128):
            assert launch.cdiv(n, d) == math.ceil(n / d)


def test_reduction_programs_never_exceed_the_tiles():
    cpu = torch.device("cpu")  # Triton's interpreter: a fixed small count
    assert launch.reduction_programs(cpu, 1, 16) == 1
    assert 1 <= launch.reduction_programs(cpu, 10_000, 16) <= 10_000
