"""Autograd collectives (megatron/core/tensor_parallel/mappings.py) on 2- and 4-rank gloo groups."""
import pytest
import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.mappings import (
    allreduce_sequence_parallel_gradients,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
    sum_over_group,
)
from tests.dist_utils import run_distributed

MAPPINGS = (copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
            scatter_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region,
            scatter_to_sequence_parallel_region, gather_from_sequence_parallel_region,
            reduce_scatter_to_sequence_parallel_region)


def _randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("mapping", MAPPINGS)
def test_identity_without_group(mapping):
    x = torch.randn(3, 4, requires_grad=True)
    assert mapping(x, None) is x


def _run(mapping, x, grad_y, group):
    """y = mapping(x, group); backward with dL/dy = grad_y; returns (y, dL/dx)."""
    x = x.clone().requires_grad_(True)
    y = mapping(x, group)
    y.backward(grad_y)
    return y.detach(), x.grad


def _assert_adjoint(x, y, grad_x, grad_y, group):
    """The backward is the conjugate of the forward: sum_r <f(x)_r, g_r> == sum_r <x_r, f*(g)_r>."""
    inner = torch.stack([(y * grad_y).sum(), (x * grad_x).sum()])
    dist.all_reduce(inner, group=group)
    torch.testing.assert_close(inner[0], inner[1], rtol=1e-12, atol=1e-12)


def _check_group(group, ranks):
    """Every mapping on ``group`` (global ``ranks``) against its definition, computed locally."""
    k, me = len(ranks), ranks.index(dist.get_rank())
    per_rank_x = [_randn((3, 2, 4), 100 + r) for r in ranks]  # a different tensor on each rank
    per_rank_g = [_randn((3, 2, 4), 200 + r) for r in ranks]
    x, g = per_rank_x[me], per_rank_g[me]

    # Replicated tensors are one vector of the global computation: only rank 0's copy enters the
    # global inner products of the adjoint check.
    replicated = _randn((3, 2, 4), 300)
    y, gx = _run(copy_to_tensor_model_parallel_region, replicated, g, group)
    assert torch.equal(y, replicated)
    torch.testing.assert_close(gx, sum(per_rank_g), rtol=1e-12, atol=1e-12)
    _assert_adjoint(replicated * (me == 0), y, gx, g, group)

    replicated_grad = _randn((3, 2, 4), 400)
    y, gx = _run(reduce_from_tensor_model_parallel_region, x, replicated_grad, group)
    torch.testing.assert_close(y, sum(per_rank_x), rtol=1e-12, atol=1e-12)
    assert torch.equal(gx, replicated_grad)
    _assert_adjoint(x, y * (me == 0), gx, replicated_grad, group)
    _check_reduction_in_place(group, x, sum(per_rank_x), replicated_grad)

    full = _randn((3, 2, 4 * k), 500)  # replicated input of the scatter
    y, gx = _run(scatter_to_tensor_model_parallel_region, full, g, group)
    assert torch.equal(y, full[..., 4 * me:4 * (me + 1)])
    assert torch.equal(gx, torch.cat(per_rank_g, dim=-1))
    _assert_adjoint(full * (me == 0), y, gx, g, group)

    full_grad = _randn((3, 2, 4 * k), 600)  # replicated gradient of the gathered output
    y, gx = _run(gather_from_tensor_model_parallel_region, x, full_grad, group)
    assert torch.equal(y, torch.cat(per_rank_x, dim=-1))
    assert torch.equal(gx, full_grad[..., 4 * me:4 * (me + 1)])
    _assert_adjoint(x, y * (me == 0), gx, full_grad, group)
    _check_sequence_parallel(group, k, me, per_rank_x, per_rank_g)


def _check_reduction_in_place(group, x, expected, grad_y):
    """The reduction sums a fresh result (a GEMM's view) in its own memory, and gets the gradient
    through; an input another backward saved makes that backward raise instead of using the sum."""
    leaf = x.clone().requires_grad_(True)
    partial = torch.nn.functional.linear(leaf.unsqueeze(0), torch.eye(4, dtype=torch.float64))[0]
    y = reduce_from_tensor_model_parallel_region(partial, group)
    assert y.data_ptr() == partial.data_ptr()
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    y.backward(grad_y)
    assert torch.equal(leaf.grad, grad_y)
    saved = x.clone().requires_grad_(True) * 1.0
    sine = saved.sin()  # saves its input for backward
    reduce_from_tensor_model_parallel_region(saved, group)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        sine.sum().backward()


def _check_sequence_parallel(group, k, me, per_rank_x, per_rank_g):
    """The sequence-parallel mappings split and join dim 0; the reference is the local cat / sum."""
    x, g = per_rank_x[me], per_rank_g[me]  # [3, 2, 4]: this rank's block of 3 positions
    full = _randn((3 * k, 2, 4), 700)  # replicated [s, b, h]
    y, gx = _run(scatter_to_sequence_parallel_region, full, g, group)
    assert torch.equal(y, full[3 * me:3 * (me + 1)])
    assert torch.equal(gx, torch.cat(per_rank_g, dim=0))
    _assert_adjoint(full * (me == 0), y, gx, g, group)

    # gather: forward cat of the blocks on every rank, each copy feeding a different computation
    # (a TP-split GEMM), so the copies are distinct outputs; backward the sum over ranks of their
    # gradients, cut to my block
    per_rank_full_g = [_randn((3 * k, 2, 4), 800 + r) for r in range(k)]
    y, gx = _run(gather_from_sequence_parallel_region, x, per_rank_full_g[me], group)
    assert torch.equal(y, torch.cat(per_rank_x, dim=0))
    torch.testing.assert_close(gx, sum(per_rank_full_g)[3 * me:3 * (me + 1)], rtol=1e-12, atol=1e-12)
    _assert_adjoint(x, y, gx, per_rank_full_g[me], group)

    # reduce-scatter: forward my block of the sum of every rank's partial [s, b, h]; backward cat
    per_rank_partial = [_randn((3 * k, 2, 4), 900 + r) for r in range(k)]
    y, gx = _run(reduce_scatter_to_sequence_parallel_region, per_rank_partial[me], g, group)
    torch.testing.assert_close(y, sum(per_rank_partial)[3 * me:3 * (me + 1)], rtol=1e-12, atol=1e-12)
    assert torch.equal(gx, torch.cat(per_rank_g, dim=0))
    _assert_adjoint(per_rank_partial[me], y, gx, g, group)

    with pytest.raises(ValueError, match="divisible by --tensor-model-parallel-size"):
        scatter_to_sequence_parallel_region(_randn((3 * k + 1, 2), 1), group)

    # a marked parameter's gradient is summed over the group as backward computes it; others are not
    norm = torch.nn.LayerNorm(4, dtype=torch.float64)
    norm.weight.sequence_parallel = True
    assert len(allreduce_sequence_parallel_gradients(norm, group)) == 1
    norm(x).mul(g).sum().backward()
    reference = torch.nn.LayerNorm(4, dtype=torch.float64)
    per_rank_weight_grads, per_rank_bias_grads = [], []
    for block, block_grad in zip(per_rank_x, per_rank_g):
        reference.zero_grad()
        reference(block).mul(block_grad).sum().backward()
        per_rank_weight_grads.append(reference.weight.grad.clone())
        per_rank_bias_grads.append(reference.bias.grad.clone())
    torch.testing.assert_close(norm.weight.grad, sum(per_rank_weight_grads), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(norm.bias.grad, per_rank_bias_grads[me], rtol=1e-12, atol=1e-12)


def _mappings_world4(rank, world_size):
    pairs = [[0, 1], [2, 3]]
    pair_groups = [dist.new_group(ranks) for ranks in pairs]  # every rank creates both
    mine = rank // 2
    _check_group(pair_groups[mine], pairs[mine])
    world_group = dist.new_group(list(range(world_size)))
    _check_group(world_group, list(range(world_size)))
    single = [dist.new_group([r]) for r in range(world_size)][rank]
    for mapping in MAPPINGS:
        x = torch.randn(2, 3)
        assert mapping(x, single) is x
    count = torch.tensor(float(rank + 1), requires_grad=True)
    total = sum_over_group(count, world_group)
    assert total.item() == sum(range(1, world_size + 1)) and not total.requires_grad and count.item() == rank + 1
    assert sum_over_group(count, None) is count


@pytest.mark.distributed
def test_mappings_on_2_and_4_ranks():
    run_distributed(_mappings_world4, 4)
