"""Rank grid, validation and process groups (megatron/core/parallel_state.py)."""

import pytest
import torch
import torch.distributed as dist

from megatron.core.parallel_state import (
    PP_FLAG,
    TP_FLAG,
    ParallelConfigError,
    check_divisible,
    group_rank_lists,
    initialize_model_parallel,
    rank_grid,
    single_rank_groups,
    validate_parallel_sizes,
)
from tests.dist_utils import run_distributed

SHAPES = [(w, tp, pp) for w in (1, 2, 4, 8, 16) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8)
          if w % (tp * pp) == 0]


@pytest.mark.parametrize("world_size,tp,pp", SHAPES)
def test_rank_grid_matches_deepspeed_topology(world_size, tp, pp):
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    dp = world_size // (tp * pp)
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    grid = rank_grid(world_size, tp, pp)
    assert grid.shape == (pp, dp, tp)
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                assert grid[p, d, t] == topology.get_rank(pipe=p, data=d, model=t)
    lists = group_rank_lists(grid)
    for axis, ds_axis in (("tp", "model"), ("dp", "data"), ("pp", "pipe")):
        assert lists[axis] == topology.get_axis_comm_lists(ds_axis), axis
    # DeepSpeed's model-parallel group: all ranks sharing a data-parallel index.
    assert lists["model_parallel"] == [sorted(topology.get_axis_list("data", d)) for d in range(dp)]
    assert lists["embedding"] == [sorted({line[0], line[-1]}) for line in lists["pp"]]


def test_rank_grid_worked_example():
    lists = group_rank_lists(rank_grid(16, 2, 4))
    assert lists["tp"][:2] == [[0, 1], [2, 3]]
    assert lists["dp"][:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lists["pp"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert lists["embedding"] == [[0, 12], [1, 13], [2, 14], [3, 15]]


@pytest.mark.parametrize("world_size,tp,pp", [(6, 4, 1), (8, 3, 1), (8, 2, 3), (4, 8, 1)])
def test_world_size_not_multiple_names_flags_and_fix(world_size, tp, pp):
    with pytest.raises(ParallelConfigError) as info:
        rank_grid(world_size, tp, pp)
    message = str(info.value)
    assert TP_FLAG in message and PP_FLAG in message
    assert f"world size {world_size}" in message and f"multiple of {tp * pp}" in message


@pytest.mark.parametrize("tp,pp", [(0, 1), (1, 0), (-2, 1)])
def test_nonpositive_sizes_rejected(tp, pp):
    with pytest.raises(ParallelConfigError, match="must be >= 1"):
        validate_parallel_sizes(8, tp, pp)


def test_validate_parallel_sizes_returns_dp():
    assert validate_parallel_sizes(16, 2, 4) == 2
    assert validate_parallel_sizes(1, 1, 1) == 1


def test_check_divisible_message():
    check_divisible(96, 4, "--num-attention-heads", TP_FLAG)
    check_divisible(24, 4, "--num-layers", PP_FLAG)
    with pytest.raises(ParallelConfigError) as info:
        check_divisible(12, 5, "--num-attention-heads", TP_FLAG)
    message = str(info.value)
    assert "--num-attention-heads=12" in message and f"{TP_FLAG}=5" in message
    assert "10 or 15" in message and "[1, 2, 3, 4, 6, 12]" in message
    with pytest.raises(ParallelConfigError, match="--num-layers=30 is not divisible by"):
        check_divisible(30, 4, "--num-layers", PP_FLAG)
    with pytest.raises(ParallelConfigError, match="positive"):
        check_divisible(30, 0, "--num-layers", PP_FLAG)


def test_single_rank_groups():
    groups = single_rank_groups()
    assert (groups.tp, groups.dp, groups.pp, groups.embedding, groups.model_parallel) == (None,) * 5
    assert (groups.tp_size, groups.dp_size, groups.pp_size) == (1, 1, 1)
    assert groups.is_first_stage and groups.is_last_stage and groups.tp_src_rank() == 0


def test_initialize_without_torch_distributed_raises():
    assert not dist.is_initialized()
    with pytest.raises(ParallelConfigError, match="init_process_group"):
        initialize_model_parallel(1, 1)


def _ranks(group):
    return dist.get_process_group_ranks(group)


def _check_groups(rank, world_size, tp, pp):
    """This rank's ParallelGroups against the grid, plus one all-reduce over every group."""
    groups = initialize_model_parallel(tp, pp)
    dp = world_size // (tp * pp)
    p, rest = divmod(rank, dp * tp)
    d, t = divmod(rest, tp)
    assert (groups.pp_rank, groups.dp_rank, groups.tp_rank) == (p, d, t)
    assert (groups.pp_size, groups.dp_size, groups.tp_size) == (pp, dp, tp)
    expected = {
        "tp": [(p * dp + d) * tp + i for i in range(tp)],
        "dp": [(p * dp + i) * tp + t for i in range(dp)],
        "pp": [(i * dp + d) * tp + t for i in range(pp)],
        "model_parallel": [(i * dp + d) * tp + j for i in range(pp) for j in range(tp)],
    }
    expected["embedding"] = sorted({expected["pp"][0], expected["pp"][-1]}) if p in (0, pp - 1) else []
    assert list(groups.tp_ranks) == expected["tp"] and list(groups.dp_ranks) == expected["dp"]
    assert list(groups.pp_ranks) == expected["pp"]
    assert list(groups.model_parallel_ranks) == expected["model_parallel"]
    assert list(groups.embedding_ranks) == expected["embedding"]
    assert groups.tp_src_rank() == expected["tp"][0]
    assert groups.is_first_stage == (p == 0) and groups.is_last_stage == (p == pp - 1)
    for name, size in (("tp", tp), ("dp", dp), ("pp", pp)):
        assert (getattr(groups, name) is None) == (size == 1)
    assert (groups.embedding is None) == (pp == 1 or 0 < p < pp - 1)
    assert ("embedding" in groups.process_groups) == bool(expected["embedding"])
    for axis, ranks in expected.items():
        if not ranks:
            continue
        handle = groups.process_groups[axis]
        assert _ranks(handle) == ranks
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=handle)
        assert total.item() == sum(ranks)
    return groups


def _groups_world8(rank, world_size):
    for tp, pp in ((2, 2), (2, 4), (4, 2), (1, 8), (8, 1)):
        _check_groups(rank, world_size, tp, pp)


@pytest.mark.distributed
def test_groups_world8():
    run_distributed(_groups_world8, 8)


# --- DeepSpeed-Ulysses: S consecutive DP indices share their samples ---------------------------------------


def test_sequence_parallel_groups_split_the_data_parallel_lines():
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    grid = rank_grid(8, 2, 1)  # dp = 4 = S 2 x D 2
    lists = group_rank_lists(grid, sequence_parallel_size=2)
    assert lists["sp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lists["dp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]  # gradients and ZeRO over S x D
    assert lists["dp"] == PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=4).get_axis_comm_lists("data")
    assert group_rank_lists(rank_grid(16, 1, 2), sequence_parallel_size=4)["sp"] == \
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert "sp" not in group_rank_lists(grid)


def test_sequence_parallel_size_must_divide_the_data_parallel_line():
    assert validate_parallel_sizes(8, 2, 1, 2) == 4
    with pytest.raises(ParallelConfigError, match=r"world size 6 is not a multiple of .* x "
                                                  r"--ds-sequence-parallel-size \(4\)"):
        validate_parallel_sizes(6, 1, 1, 4)
    with pytest.raises(ParallelConfigError, match="--ds-sequence-parallel-size must be >= 1"):
        validate_parallel_sizes(4, 1, 1, 0)


def _sequence_parallel_groups(rank, world_size):
    groups = initialize_model_parallel(2, 1, sequence_parallel_size=2)
    expected_sp = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}[rank]
    assert list(groups.sp_ranks) == expected_sp and _ranks(groups.sp) == expected_sp
    assert (groups.sp_rank, groups.sp_size, groups.dp_size) == (rank // 2, 2, 2)
    assert (groups.data_shard_rank, groups.data_shard_size) == (0, 1)
    single = initialize_model_parallel(1, 1)
    assert single.sp is None and single.sp_ranks == (rank,) and single.data_shard_size == 4


@pytest.mark.distributed
def test_sequence_parallel_groups_world4():
    run_distributed(_sequence_parallel_groups, 4)
