"""Helpers of megatron/core/tensor_parallel/utils.py."""
import pytest
import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.utils import (
    VocabUtility,
    all_gather_along_first_dim,
    divide,
    gather_split_1d_tensor,
    split_tensor_along_last_dim,
    split_tensor_into_1d_equal_chunks,
    start_all_to_all_of_others,
)
from tests.dist_utils import run_distributed


def test_divide():
    assert divide(12, 4) == 3
    with pytest.raises(ValueError, match="10 is not divisible by 4"):
        divide(10, 4)
    with pytest.raises(ValueError, match="not divisible by 0"):
        divide(10, 0)


def test_split_tensor_along_last_dim():
    tensor = torch.arange(24.0).view(2, 3, 4)
    chunks = split_tensor_along_last_dim(tensor, 2)
    assert [c.shape for c in chunks] == [(2, 3, 2)] * 2
    assert torch.equal(torch.cat(chunks, dim=-1), tensor)
    assert not chunks[0].is_contiguous()
    assert all(c.is_contiguous() for c in split_tensor_along_last_dim(tensor, 2, contiguous_split_chunks=True))
    with pytest.raises(ValueError, match="not divisible"):
        split_tensor_along_last_dim(tensor, 3)


def test_vocab_ranges_tile_the_vocabulary():
    ranges = [VocabUtility.vocab_range_from_global_vocab_size(50304, rank, 4) for rank in range(4)]
    assert ranges == [(0, 12576), (12576, 25152), (25152, 37728), (37728, 50304)]
    assert VocabUtility.vocab_range_from_per_partition_vocab_size(10, 3, 4) == (30, 40)
    with pytest.raises(ValueError):
        VocabUtility.vocab_range_from_global_vocab_size(50257, 0, 2)


def test_1d_chunks_without_group_are_the_flat_tensor():
    tensor = torch.randn(3, 5)
    chunk = split_tensor_into_1d_equal_chunks(tensor, None)
    assert torch.equal(chunk, tensor.reshape(-1))
    assert torch.equal(gather_split_1d_tensor(chunk, None, tensor.numel()), tensor.reshape(-1))


def _utils_world2(rank, world_size):
    group = dist.new_group([0, 1])
    for shape in ((4, 6), (3, 5)):  # 24 elements split evenly; 15 padded to 2 x 8
        tensor = torch.arange(float(torch.Size(shape).numel())).view(shape)
        chunk = split_tensor_into_1d_equal_chunks(tensor, group)
        chunk_size = -(-tensor.numel() // 2)
        assert chunk.shape == (chunk_size,)
        assert torch.equal(chunk[: tensor.numel() - rank * chunk_size],
                           tensor.reshape(-1)[rank * chunk_size:(rank + 1) * chunk_size])
        assert torch.equal(gather_split_1d_tensor(chunk, group, tensor.numel()), tensor.reshape(-1))
    gathered = all_gather_along_first_dim(torch.full((2, 3), float(rank)), group)
    assert torch.equal(gathered, torch.tensor([0.0, 0.0, 1.0, 1.0])[:, None].expand(4, 3))


@pytest.mark.distributed
def test_1d_split_and_gather_on_2_ranks():
    run_distributed(_utils_world2, 2)


def _all_to_all_of_others(rank, world_size):
    """Over a group of ranks 2, 0, 1 (group ranks 0, 1, 2): every other rank's block arrives, the own
    slot keeps what the caller wrote there while the blocks travelled, and the own block is not sent."""
    group = dist.new_group([2, 0, 1])
    me = dist.get_rank(group)
    blocks = torch.stack([torch.full((2, 3), 10.0 * me + j) for j in range(3)])  # block j for group rank j
    blocks[me] = float("nan")
    received, work = start_all_to_all_of_others(blocks, group)
    received[me] = -1.0
    work.wait()
    expected = torch.stack([torch.full((2, 3), -1.0 if j == me else 10.0 * j + me) for j in range(3)])
    assert torch.equal(received, expected)


@pytest.mark.distributed
def test_all_to_all_of_others_on_3_ranks():
    run_distributed(_all_to_all_of_others, 3)
