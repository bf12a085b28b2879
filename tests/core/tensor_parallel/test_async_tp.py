"""The async-TP engine of megatron/core/tensor_parallel/async_tp.py: its gloo paths on CPU, its
symmetric-memory paths against NCCL on two GPUs."""
import socket

import pytest
import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.async_tp import (all_gather_matmul, all_gather_matmul_each_block, host_identity,
                                                    matmul_reduce_scatter, peers_reachable,
                                                    start_matmul_reduce_scatter, start_peer_all_to_all)
from megatron.core.tensor_parallel.utils import all_gather_along_first_dim, reduce_scatter_along_first_dim
from tests.dist_utils import run_distributed


def _rank_operand(rank: int) -> torch.Tensor:
    return torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(10 + rank))  # [n, b, m]


def _started_reduce_scatter(rank, world_size):
    matrix = torch.randn(5, 6, generator=torch.Generator().manual_seed(3))
    output, work = start_matmul_reduce_scatter(_rank_operand(rank), matrix, dist.group.WORLD)
    torch.randn(64, 64).matmul(torch.randn(64, 64))  # other work between start and wait
    work.wait()
    total = sum(_rank_operand(r).matmul(matrix) for r in range(world_size))  # [n, b, p]
    torch.testing.assert_close(output, total[2 * rank:2 * (rank + 1)])


@pytest.mark.distributed
def test_started_matmul_reduce_scatter_on_2_ranks():
    """start_matmul_reduce_scatter's gloo path: rank r's block of the summed products after the wait."""
    run_distributed(_started_reduce_scatter, 2)


def _blocks_seen(shard, matrix, group):
    """(all_gather_matmul_each_block's product, the blocks it passed, by rank), the blocks copied
    as they come (on CUDA a peer's block is its slot, rewritten two calls later)."""
    seen = {}
    product = all_gather_matmul_each_block(shard, matrix, group,
                                           lambda rank, block: seen.setdefault(rank, block.clone()))
    return product, seen


def _gather_by_blocks_passes_each_block(rank, world_size):
    shard, matrix = _rank_operand(rank), torch.randn(5, 6, generator=torch.Generator().manual_seed(3))
    product, seen = _blocks_seen(shard, matrix, dist.group.WORLD)
    gathered = torch.cat([_rank_operand(r) for r in range(world_size)])  # [k n, b, m]
    torch.testing.assert_close(product, gathered.matmul(matrix))
    assert sorted(seen) == list(range(world_size))
    for r, block in seen.items():
        assert torch.equal(block, _rank_operand(r).reshape(-1, 5))


@pytest.mark.distributed
def test_all_gather_matmul_each_block_on_2_ranks():
    """all_gather_matmul_each_block's gloo path: the gathered product, and every rank's block passed once."""
    run_distributed(_gather_by_blocks_passes_each_block, 2)


def _normwise_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected.double()).norm() / expected.double().norm()).item()


def _fused_collectives_match_nccl(rank, world_size):
    """The fused collectives through symmetric memory (all_gather_matmul, its each-block form, and
    matmul_reduce_scatter, started or not) against NCCL's collectives and the plain products, for
    several shapes in turn (the slots grow and alternate), with new values every call so that a slot
    read before its peer wrote it, or overwritten while read, shows."""
    import torch.nn.functional as F


    group, device = dist.group.WORLD, torch.device("cuda", rank)
    generator = torch.Generator(device).manual_seed(100 + rank)
    shapes = [(64, 3, 96, 80), (512, 2, 256, 384), (64, 3, 96, 80), (1000, 1, 128, 72)] * 4
    for call, (rows, batch, inner, columns) in enumerate(shapes):
        def randn(*shape):
            return torch.randn(*shape, generator=generator, device=device, dtype=torch.bfloat16)

        shard, weight, bias = randn(rows, batch, inner), randn(columns, inner), randn(columns)
        gathered, product = all_gather_matmul(shard, weight.t(), group, bias if call % 2 else None)
        expected_gathered = all_gather_along_first_dim(shard, group)
        assert torch.equal(gathered, expected_gathered), f"call {call}: gathered input"
        expected = F.linear(expected_gathered, weight, bias if call % 2 else None)
        assert product.shape == expected.shape and _normwise_error(product, expected) < 1e-2, f"call {call}"
        full = randn(world_size * rows, batch, inner)
        block = matmul_reduce_scatter(full, weight.t(), group)
        expected_block = reduce_scatter_along_first_dim(F.linear(full, weight), group)
        assert block.shape == expected_block.shape and _normwise_error(block, expected_block) < 1e-2, f"call {call}"
        started, work = start_matmul_reduce_scatter(full, weight.t(), group)
        randn(*full.shape).matmul(weight.t())  # allocations between start and wait must not reuse what is in flight
        work.wait()
        assert _normwise_error(started, expected_block) < 1e-2, f"call {call}: started"
        product, seen = _blocks_seen(shard, weight.t(), group)
        assert _normwise_error(product, F.linear(expected_gathered, weight)) < 1e-2, f"call {call}: by blocks"
        assert torch.equal(torch.cat([seen[r] for r in range(world_size)]),
                           expected_gathered.reshape(-1, inner)), f"call {call}: blocks"


def _overlapped_layers(rank, world_size, fp8_recipe=None):
    """Column- then row-parallel layer under sequence parallelism on the GPU, fp32 (or bf16 with FP8
    GEMMs of ``fp8_recipe``): --tp-comm-overlap's pipelined collectives give the outputs and
    gradients of the plain NCCL ones."""
    from megatron.core.tensor_parallel.fp8 import Fp8Config
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    group, device = dist.group.WORLD, torch.device("cuda", rank)
    dtype = torch.float32 if fp8_recipe is None else torch.bfloat16
    fp8 = None if fp8_recipe is None else Fp8Config(format="hybrid", recipe=fp8_recipe)
    hidden, ffn, seq, batch = 64, 256, 32, 3
    torch.manual_seed(5 + rank)
    x_block = torch.randn(seq // world_size, batch, hidden, device=device, dtype=dtype)
    grad_block = torch.randn(seq // world_size, batch, hidden, device=device, dtype=dtype)
    results = []
    for comm_overlap in (False, True):
        layers = []
        for layer, sizes in ((ColumnParallelLinear, (hidden, ffn)), (RowParallelLinear, (ffn, hidden))):
            torch.manual_seed(1234)
            layers.append(layer(*sizes, tp_group=group, init_method=torch.nn.init.normal_, device=device,
                                params_dtype=dtype, use_cpu_initialization=True, sequence_parallel=True,
                                comm_overlap=comm_overlap, fp8=fp8))
        x = x_block.clone().requires_grad_(True)
        y, _ = layers[1](torch.relu(layers[0](x)[0]))
        y.backward(grad_block)
        results.append([y, x.grad] + [p.grad for layer in layers for p in layer.parameters()])
    for plain, overlapped in zip(*results):
        assert _normwise_error(overlapped, plain) < (1e-5 if fp8 is None else 5e-3)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fused_collectives_match_nccl_on_two_gpus():
    run_distributed(_fused_collectives_match_nccl, 2, backend="nccl")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_overlapped_layers_on_two_gpus():
    run_distributed(_overlapped_layers, 2, backend="nccl")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2 or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs 2 Hopper GPUs")
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "rowwise"])
def test_overlapped_fp8_layers_on_two_gpus(recipe):
    run_distributed(_overlapped_layers, 2, recipe, backend="nccl")


def test_peers_are_reachable_on_one_host_with_peer_access_only():
    def linked(*pairs):  # CUDA indices that can map each other's memory
        return lambda mine, theirs: (mine, theirs) in pairs or (theirs, mine) in pairs

    all_visible = {"gpu-a": 0, "gpu-b": 1, "gpu-c": 2}
    one_host = [("node-1/boot-1", "gpu-a"), ("node-1/boot-1", "gpu-b"), ("node-1/boot-1", "gpu-c")]
    assert all(peers_reachable(one_host, rank, all_visible, linked((0, 1), (0, 2), (1, 2))) for rank in range(3))
    assert not peers_reachable(one_host, 0, all_visible, linked((0, 1)))  # a has no access to c
    assert peers_reachable(one_host, 1, all_visible, linked((0, 1), (1, 2)))  # b reaches both; the group's answer
    assert not peers_reachable(one_host, 0, all_visible, linked((0, 1), (1, 2)))  # (the minimum) is still no
    own_gpu_only = [{"gpu-a": 0}, {"gpu-b": 0}, {"gpu-c": 0}]  # a launcher showing each process its own GPU
    assert not any(peers_reachable(one_host, rank, own_gpu_only[rank], linked()) for rank in range(3))
    reordered = {"gpu-c": 0, "gpu-a": 1, "gpu-b": 2}  # another order of the same GPUs: reached by identity
    assert peers_reachable(one_host, 2, reordered, linked((0, 1), (0, 2), (1, 2)))
    two_hosts = [("node-1/boot-1", "gpu-a"), ("node-2/boot-7", "gpu-x")]
    assert not any(peers_reachable(two_hosts, rank, {"gpu-a": 0, "gpu-x": 1}, linked((0, 1))) for rank in range(2))
    same_name = [("node-1/boot-1", "gpu-a"), ("node-1/boot-2", "gpu-b")]  # one name, two machines
    assert not peers_reachable(same_name, 0, all_visible, linked((0, 1)))
    assert host_identity().startswith(socket.gethostname() + "/")


def _peer_all_to_all_matches_nccl(rank, world_size):
    """start_peer_all_to_all against NCCL's all_to_all_single: strided sources (as Ulysses sends them),
    several exchanges in flight at once over both slots, shapes that grow the slots, sources dropped
    before the wait, new allocations between start and wait, every third exchange landing in a
    strided destination (``into``), and every third without the own block (``with_own=False``: the
    caller's own slot, written while the others travel, kept)."""
    group, device = dist.group.WORLD, torch.device("cuda", rank)
    generator = torch.Generator(device).manual_seed(200 + rank)
    for rows, width in [(16, 24), (256, 96), (16, 24), (1024, 40)] * 3:
        started, expected = [], []
        for index in range(3):
            whole = torch.randn(rows, 2, world_size * width, generator=generator, device=device,
                                dtype=torch.bfloat16)
            blocks = whole.unflatten(-1, (world_size, width)).movedim(2, 0)  # [k, rows, 2, width], strided
            reference = torch.empty_like(blocks.contiguous())
            dist.all_to_all_single(reference, blocks.contiguous(), group=group)
            expected.append(reference)
            into = torch.zeros_like(whole).unflatten(-1, (world_size, width)).movedim(2, 0) if index == 2 else None
            started.append(start_peer_all_to_all(blocks, group, into, with_own=index != 1))
            assert into is None or started[-1][0] is into
            if index == 1:
                started[-1][0][rank].fill_(7.0)
                reference[rank] = 7.0
            del whole, blocks
            torch.randn(rows, 2, world_size * width, device=device).mul_(2)  # reuses freed memory, if allowed
        for (received, work), reference in zip(started, expected):
            work.wait()
            assert torch.equal(received, reference), (rows, width)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_peer_all_to_all_matches_nccl_on_two_gpus():
    run_distributed(_peer_all_to_all_matches_nccl, 2, backend="nccl")
