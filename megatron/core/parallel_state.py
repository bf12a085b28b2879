"""The rank grid of tensor (TP), data (DP) and pipeline (PP) parallelism, and its process groups.

The W = tp * dp * pp global ranks form one array ``grid`` of shape [pp, dp, tp]:
``grid[p, d, t] = (p * dp + d) * tp + t``. TP varies fastest (a TP group is a run of consecutive ranks,
ideally one node), then DP, then PP. This is Megatron's order and exactly DeepSpeed's
``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`` (axes pipe, data, model).

Each group is a line of the grid along one axis:

    TP group of (p, d)   grid[p, d, :]
    DP group of (p, t)   grid[p, :, t]
    PP group of (d, t)   grid[:, d, t]
    model-parallel group of d (TP x PP, DeepSpeed's "model parallel")   grid[:, d, :]
    embedding group of (d, t)   {grid[0, d, t], grid[pp - 1, d, t]}   (tied input/output embedding)

DeepSpeed-Ulysses sequence parallelism (--ds-sequence-parallel-size S) splits the DP axis further: its
dp = S * D indices form D runs of S consecutive ones, d = data_rank * S + sp_rank. The S ranks of a run
(the sequence-parallel, SP, group) read the same samples and each holds 1 / S of every sequence; the
weights are replicated over them like over DP, so the whole DP line (S * D ranks) is still the group
that averages gradients and partitions ZeRO states, and DeepSpeed's topology keeps num_dp = S * D:

    SP group of (p, r, t)   grid[p, r * S : (r + 1) * S, t]   (r = data_rank < D)

Example, W = 16, tp = 2, pp = 4 (dp = 2):
    TP groups  [0, 1] [2, 3] ... [14, 15]
    DP groups  [0, 2] [1, 3] [4, 6] [5, 7] ...
    PP groups  [0, 4, 8, 12] [1, 5, 9, 13] [2, 6, 10, 14] [3, 7, 11, 15]
    embedding  [0, 12] [1, 13] [2, 14] [3, 15]
Example, W = 8, tp = 2, pp = 1, S = 2 (dp = 4, D = 2):
    DP groups  [0, 2, 4, 6] [1, 3, 5, 7]      SP groups  [0, 2] [1, 3] [4, 6] [5, 7]

Groups are values handed to layers explicitly (``ParallelGroups``); nothing here is global.
"""
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch.distributed as dist
from torch.distributed import ProcessGroup

TP_FLAG = "--tensor-model-parallel-size"
PP_FLAG = "--pipeline-model-parallel-size"
SP_FLAG = "--ds-sequence-parallel-size"


class ParallelConfigError(ValueError):
    """A parallel layout that cannot work; the message names the flags and the fix."""


def check_divisible(value: int, divisor: int, what_flag: str, by_flag: str) -> None:
    """Raise ParallelConfigError unless ``value % divisor == 0``.

    Used for the shapes that a parallel layout splits evenly, e.g.
    ``check_divisible(num_heads, tp, "--num-attention-heads", TP_FLAG)``, the same for
    ``--ffn-hidden-size`` and the padded vocabulary, and
    ``check_divisible(num_layers, pp, "--num-layers", PP_FLAG)`` for a uniform pipeline split.
    """
    if divisor <= 0:
        raise ParallelConfigError(f"{by_flag} must be a positive integer, got {divisor}")
    if value % divisor == 0:
        return
    lower, upper = (value // divisor) * divisor, (value // divisor + 1) * divisor
    multiples = f"{lower} or {upper}" if lower > 0 else f"{upper}"
    small_divisors = [d for d in range(1, min(value, 64) + 1) if value % d == 0]
    raise ParallelConfigError(
        f"{what_flag}={value} is not divisible by {by_flag}={divisor}: set {what_flag} to a multiple "
        f"of {divisor} (e.g. {multiples}) or {by_flag} to a divisor of {value} (e.g. {small_divisors})")


def validate_parallel_sizes(world_size: int, tensor_model_parallel_size: int,
                            pipeline_model_parallel_size: int, sequence_parallel_size: int = 1) -> int:
    """Check that W = tp * dp * pp has an integer solution dp >= 1 with dp a multiple of the
    sequence-parallel size S; return dp (= S * D, the gradient-averaging DP degree)."""
    for flag, size in ((TP_FLAG, tensor_model_parallel_size), (PP_FLAG, pipeline_model_parallel_size),
                       (SP_FLAG, sequence_parallel_size)):
        if size < 1:
            raise ParallelConfigError(f"{flag} must be >= 1, got {size}")
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size
    if sequence_parallel_size > 1 and world_size % (model_parallel * sequence_parallel_size) != 0:
        raise ParallelConfigError(
            f"world size {world_size} is not a multiple of {TP_FLAG} ({tensor_model_parallel_size}) x "
            f"{PP_FLAG} ({pipeline_model_parallel_size}) x {SP_FLAG} ({sequence_parallel_size}): launch a "
            f"multiple of {model_parallel * sequence_parallel_size} processes")
    if world_size % model_parallel != 0:
        fitting = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ParallelConfigError(
            f"world size {world_size} is not a multiple of {TP_FLAG} ({tensor_model_parallel_size}) x "
            f"{PP_FLAG} ({pipeline_model_parallel_size}) = {model_parallel}: launch a multiple of "
            f"{model_parallel} processes, or choose sizes whose product divides {world_size} "
            f"(one of {fitting})")
    return world_size // model_parallel


def rank_grid(world_size: int, tensor_model_parallel_size: int,
              pipeline_model_parallel_size: int) -> np.ndarray:
    """Global ranks laid out as [pp, dp, tp] (TP fastest); see the module docstring."""
    dp = validate_parallel_sizes(world_size, tensor_model_parallel_size, pipeline_model_parallel_size)
    return np.arange(world_size).reshape(pipeline_model_parallel_size, dp, tensor_model_parallel_size)


def group_rank_lists(grid: np.ndarray, sequence_parallel_size: int = 1) -> dict[str, list[list[int]]]:
    """Every group of every axis as sorted global-rank lists, in the creation order all ranks share.

    Keys: "tp", "dp", "pp", "model_parallel" (TP x PP, one per DP index), "embedding" (first and
    last stage of each pipeline; a single rank when pp == 1); with S > 1 also "sp" (runs of S
    consecutive DP indices, see the module docstring).
    """
    pp, dp, tp = grid.shape
    sp = sequence_parallel_size
    pipelines = grid.transpose(1, 2, 0).reshape(-1, pp)  # [dp * tp, pp]
    sequence_parallel = {} if sp == 1 else {
        "sp": grid.reshape(pp, dp // sp, sp, tp).transpose(0, 1, 3, 2).reshape(-1, sp).tolist()}
    return {
        "tp": grid.reshape(-1, tp).tolist(),
        "dp": grid.transpose(0, 2, 1).reshape(-1, dp).tolist(),  # [pp * tp, dp]
        "pp": pipelines.tolist(),
        "model_parallel": grid.transpose(1, 0, 2).reshape(dp, pp * tp).tolist(),  # [dp, pp * tp]
        "embedding": [sorted({int(line[0]), int(line[-1])}) for line in pipelines],
        **sequence_parallel,
    }


def group_size(group: ProcessGroup | None) -> int:
    """Number of ranks in ``group``; 1 for None (the identity group)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This rank's index in ``group``; 0 for None (the identity group)."""
    return 0 if group is None else dist.get_rank(group)


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups of one rank of the TP x DP x PP grid (Megatron order: TP fastest, then DP, then PP).

    ``sp`` (DeepSpeed-Ulysses, None when S = 1) is the group of the S ranks inside this rank's DP line
    that share its samples; ``dp`` is the whole DP line, S * D ranks (gradients, ZeRO). The D sample
    streams (data shards) of the DP line are counted by ``data_shard_size`` and indexed by ``data_shard_rank``.

    ``tp``, ``dp``, ``pp`` are None when that axis has size 1 (or torch.distributed is not
    initialised): every collective helper treats None as the identity. ``embedding`` is the group of
    the first and last stage of this rank's pipeline, None when pp == 1 or this rank is a middle
    stage (whose ``embedding_ranks`` is empty). ``process_groups`` keeps a real handle for every axis, size-1 axes included, for code
    where None would mean the whole world (torch.distributed, DeepSpeed's ``mpu``).
    """

    tp: ProcessGroup | None
    dp: ProcessGroup | None
    pp: ProcessGroup | None
    embedding: ProcessGroup | None
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    pp_rank: int
    pp_size: int
    global_rank: int = 0
    tp_ranks: tuple[int, ...] = (0,)
    dp_ranks: tuple[int, ...] = (0,)
    pp_ranks: tuple[int, ...] = (0,)
    model_parallel_ranks: tuple[int, ...] = (0,)
    embedding_ranks: tuple[int, ...] = (0,)
    sp: ProcessGroup | None = None
    sp_rank: int = 0
    sp_size: int = 1
    sp_ranks: tuple[int, ...] = (0,)
    process_groups: Mapping[str, ProcessGroup] = field(default_factory=dict, compare=False, repr=False)

    @property
    def data_shard_size(self) -> int:
        """D = dp / S: the number of distinct sample streams, what batch arithmetic divides by."""
        return self.dp_size // self.sp_size

    @property
    def data_shard_rank(self) -> int:
        """This rank's sample stream, < D; the same on the S ranks of an SP group."""
        return self.dp_rank // self.sp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def model_parallel(self) -> ProcessGroup | None:
        """The TP x PP group of this rank (DeepSpeed's model-parallel group), None when of size 1."""
        return self.process_groups.get("model_parallel") if len(self.model_parallel_ranks) > 1 else None

    def tp_src_rank(self) -> int:
        """Global rank of TP rank 0 in this rank's TP group (the source of TP broadcasts)."""
        return self.tp_ranks[0]


def single_rank_groups() -> ParallelGroups:
    """Groups of a run without any parallelism (tp = dp = pp = 1); needs no torch.distributed."""
    return ParallelGroups(tp=None, dp=None, pp=None, embedding=None,
                          tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1)


def _new_groups(rank_lists: list[list[int]], my_rank: int) -> tuple[ProcessGroup | None, list[int]]:
    """Create one group per list (every rank calls this with the same lists); return mine, if any."""
    mine = (None, [])
    for ranks in rank_lists:
        group = dist.new_group(ranks=ranks)
        if my_rank in ranks:
            mine = (group, ranks)
    return mine


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              sequence_parallel_size: int = 1) -> ParallelGroups:
    """Build this rank's TP, DP, PP, model-parallel, embedding and SP groups; see the module docstring.

    Collective: every rank of the world must call it with the same sizes, since torch.distributed
    requires each new group to be created by all ranks in the same order.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ParallelConfigError("initialize_model_parallel needs torch.distributed: call "
                                  "torch.distributed.init_process_group (or deepspeed.init_distributed) first")
    world_size, my_rank = dist.get_world_size(), dist.get_rank()
    validate_parallel_sizes(world_size, tensor_model_parallel_size, pipeline_model_parallel_size,
                            sequence_parallel_size)
    grid = rank_grid(world_size, tensor_model_parallel_size, pipeline_model_parallel_size)
    pp_rank, dp_rank, tp_rank = (int(i) for i in np.unravel_index(my_rank, grid.shape))
    handles, ranks = {}, {}
    for axis, lists in group_rank_lists(grid, sequence_parallel_size).items():
        handles[axis], ranks[axis] = _new_groups(lists, my_rank)
    if handles["embedding"] is None:  # a middle pipeline stage
        del handles["embedding"]
    pp_size, dp_size, tp_size = grid.shape
    is_embedding_stage = pp_size > 1 and pp_rank in (0, pp_size - 1)
    return ParallelGroups(
        tp=handles["tp"] if tp_size > 1 else None,
        dp=handles["dp"] if dp_size > 1 else None,
        pp=handles["pp"] if pp_size > 1 else None,
        embedding=handles["embedding"] if is_embedding_stage else None,
        tp_rank=tp_rank, tp_size=tp_size, dp_rank=dp_rank, dp_size=dp_size, pp_rank=pp_rank, pp_size=pp_size,
        global_rank=my_rank,
        tp_ranks=tuple(ranks["tp"]), dp_ranks=tuple(ranks["dp"]), pp_ranks=tuple(ranks["pp"]),
        model_parallel_ranks=tuple(ranks["model_parallel"]), embedding_ranks=tuple(ranks["embedding"]),
        sp=handles.get("sp"), sp_rank=dp_rank % sequence_parallel_size, sp_size=sequence_parallel_size,
        sp_ranks=tuple(ranks.get("sp", [my_rank])),
        process_groups=handles,
    )
