"""The ``mpu`` object DeepSpeed reads the model-parallel layout from."""
from torch.distributed import ProcessGroup

from megatron.core.parallel_state import ParallelConfigError, ParallelGroups


class DeepSpeedMPU:
    """The ``mpu`` object DeepSpeed expects (``deepspeed.initialize(mpu=...)``,
    ``deepspeed.checkpointing.configure(mpu)``), answering from a ``ParallelGroups``.

    Semantics follow DeepSpeed's own ``PipelineParallelGrid``: "model parallel" is the TP x PP group
    of ranks sharing a DP index (used for overflow checks, gradient norms and ``mp_rank_XX``
    checkpoint names); "slice" and "tensor model parallel" are the TP group. Groups are real process
    groups even when of size 1, since DeepSpeed reads ``group=None`` as the whole world.
    """

    def __init__(self, groups: ParallelGroups):
        if not groups.process_groups:
            raise ParallelConfigError("DeepSpeedMPU needs groups from initialize_model_parallel() (after "
                                      "torch.distributed is initialised), not single_rank_groups()")
        self.groups = groups

    def _group(self, axis: str) -> ProcessGroup:
        return self.groups.process_groups[axis]

    def get_model_parallel_rank(self) -> int:
        return self.groups.model_parallel_ranks.index(self.groups.global_rank)

    def get_model_parallel_world_size(self) -> int:
        return len(self.groups.model_parallel_ranks)

    def get_model_parallel_group(self) -> ProcessGroup:
        return self._group("model_parallel")

    def get_data_parallel_rank(self) -> int:
        return self.groups.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.groups.dp_size

    def get_data_parallel_group(self) -> ProcessGroup:
        return self._group("dp")

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.groups.dp_ranks)

    def get_tensor_model_parallel_rank(self) -> int:
        return self.groups.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.groups.tp_size

    def get_tensor_model_parallel_group(self) -> ProcessGroup:
        return self._group("tp")

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.groups.tp_src_rank()

    get_slice_parallel_rank = get_tensor_model_parallel_rank
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_group = get_tensor_model_parallel_group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.groups.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.groups.pp_size

    def get_pipeline_model_parallel_group(self) -> ProcessGroup:
        return self._group("pp")

    get_pipe_parallel_rank = get_pipeline_model_parallel_rank
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    get_pipe_parallel_group = get_pipeline_model_parallel_group

    def is_pipeline_first_stage(self) -> bool:
        return self.groups.is_first_stage

    def is_pipeline_last_stage(self) -> bool:
        return self.groups.is_last_stage
