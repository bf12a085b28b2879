"""all_to_all (megatron/core/tensor_parallel/mappings.py), DeepSpeed-Ulysses' collective, on 2 gloo ranks:
the forward is the block permutation its table states, the backward its adjoint (the inverse permutation)."""
import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import all_to_all, sum_over_group
from tests.dist_utils import run_distributed

BATCH, HEADS, SEQ, DIM = 2, 4, 6, 3


def _global(seed):
    return torch.randn(BATCH, HEADS, SEQ, DIM, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _permutes_sequence_and_heads(rank, world_size):
    group = dist.new_group(list(range(world_size)))
    seq_block, head_block = SEQ // world_size, HEADS // world_size
    full, upstream = _global(1), _global(2)
    x = full[:, :, rank * seq_block:(rank + 1) * seq_block].clone().requires_grad_(True)  # my positions
    y = all_to_all(x, group, scatter_dim=1, gather_dim=2)
    my_heads = slice(rank * head_block, (rank + 1) * head_block)
    assert torch.equal(y, full[:, my_heads])  # all positions of my heads
    y.backward(upstream[:, my_heads])
    assert torch.equal(x.grad, upstream[:, :, rank * seq_block:(rank + 1) * seq_block])
    back = all_to_all(y.detach(), group, scatter_dim=2, gather_dim=1)
    assert torch.equal(back, x.detach())
    count = sum_over_group(torch.tensor(float(rank + 1)), group)
    assert count.item() == sum(range(1, world_size + 1))


def test_all_to_all_permutes_blocks_and_its_backward_is_the_inverse():
    run_distributed(_permutes_sequence_and_heads, 2)


def test_identity_on_a_group_of_one():
    x = torch.randn(2, 4, 6, 3, requires_grad=True)
    assert all_to_all(x, None, scatter_dim=1, gather_dim=2) is x
    assert sum_over_group(x, None) is x
