"""The ``mpu`` DeepSpeed reads our layout from (megatron/training/engine/mpu.py): it answers like
DeepSpeed's own PipelineParallelGrid, and an engine given it reduces over our groups."""
import os

import pytest
import torch

from megatron.core.parallel_state import ParallelConfigError, TP_FLAG, initialize_model_parallel, single_rank_groups
from megatron.training.engine.mpu import DeepSpeedMPU
from tests.core.test_parallel_state import _check_groups, _ranks
from tests.dist_utils import run_distributed


def test_single_rank_groups_have_no_mpu():
    with pytest.raises(ParallelConfigError, match="initialize_model_parallel"):
        DeepSpeedMPU(single_rank_groups())


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


@pytest.mark.distributed
def test_groups_and_deepspeed_mpu_world4():
    run_distributed(_groups_and_deepspeed_world4, 4)


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
