"""Rank grid, validation, process groups and the DeepSpeed mpu adapter (megatron/core/parallel_state.py)."""
import os

import pytest
import torch
import torch.distributed as dist

from megatron.core.parallel_state import (
    PP_FLAG,
    TP_FLAG,
    DeepSpeedMPU,
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
    with pytest.raises(ParallelConfigError, match="initialize_model_parallel"):
        DeepSpeedMPU(groups)


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


def _check_deepspeed_mpu(groups, tp, pp):
    """Every mpu method DeepSpeed calls answers like DeepSpeed's own PipelineParallelGrid."""
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology

    grid = PipelineParallelGrid(PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=groups.dp_size))
    mpu = DeepSpeedMPU(groups)
    grid_groups = {"model_parallel": grid.get_model_parallel_group, "data_parallel": grid.get_data_parallel_group,
                   "tensor_model_parallel": grid.get_slice_parallel_group, "slice_parallel": grid.get_slice_parallel_group,
                   "pipeline_model_parallel": grid.get_pipe_parallel_group, "pipe_parallel": grid.get_pipe_parallel_group}
    for prefix in ("model_parallel", "data_parallel", "tensor_model_parallel", "pipeline_model_parallel",
                   "pipe_parallel", "slice_parallel"):
        assert getattr(mpu, f"get_{prefix}_rank")() == getattr(grid, f"get_{prefix}_rank")(), prefix
        assert getattr(mpu, f"get_{prefix}_world_size")() == getattr(grid, f"get_{prefix}_world_size")(), prefix
        assert _ranks(getattr(mpu, f"get_{prefix}_group")()) == _ranks(grid_groups[prefix]()), prefix
    assert mpu.get_data_parallel_group_ranks() == grid.get_data_parallel_group_ranks()
    assert mpu.get_tensor_model_parallel_src_rank() == _ranks(grid.get_slice_parallel_group())[0]
    assert mpu.is_pipeline_first_stage() == grid.is_first_stage
    assert mpu.is_pipeline_last_stage() == grid.is_last_stage


def _groups_and_deepspeed_world4(rank, world_size):
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)):
        groups = _check_groups(rank, world_size, tp, pp)
        _check_deepspeed_mpu(groups, tp, pp)
    with pytest.raises(ParallelConfigError, match=TP_FLAG):
        initialize_model_parallel(3, 1)


def _groups_world8(rank, world_size):
    for tp, pp in ((2, 2), (2, 4), (4, 2), (1, 8), (8, 1)):
        _check_groups(rank, world_size, tp, pp)


@pytest.mark.distributed
def test_groups_and_deepspeed_mpu_world4():
    run_distributed(_groups_and_deepspeed_world4, 4)


@pytest.mark.distributed
def test_groups_world8():
    run_distributed(_groups_world8, 8)


def _deepspeed_engine_world4(rank, world_size):
    """A ZeRO-1 engine given our mpu averages gradients over our DP group and takes the clipping
    norm over our model-parallel (TP) group."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    groups = initialize_model_parallel(tensor_model_parallel_size=2)
    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    model.weight.tensor_model_parallel = True  # a TP slice: its norm is summed over the TP group
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                      config=config, mpu=DeepSpeedMPU(groups))
    assert (engine.dp_world_size, engine.mp_world_size) == (groups.dp_size, 2)
    engine.backward(engine(torch.full((1, 4), float(rank))).sum())  # dL/dW = rank
    engine.step()
    # DP groups {0, 2} and {1, 3} average to 1 and 2 (the world would give 1.5 everywhere); the TP
    # pair then holds 4 entries of each, a norm of sqrt(4 * 1 + 4 * 4).
    dp_mean_grad = sum(groups.dp_ranks) / len(groups.dp_ranks)
    expected = 1.0 - dp_mean_grad / (20 ** 0.5 + 1e-6)
    torch.testing.assert_close(model.weight.detach(), torch.full((1, 4), expected), rtol=1e-6, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.slow
def test_deepspeed_engine_reduces_over_our_dp_group():
    run_distributed(_deepspeed_engine_world4, 4)
