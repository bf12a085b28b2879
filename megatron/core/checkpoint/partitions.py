"""The merge and split between one full tensor and its k tensor-parallel partitions.

A parameter is either replicated (every rank holds all of it) or split along one dimension d into k
partitions. With stride s the dimension is cut into k * s blocks and rank r holds blocks r, r + k,
..., r + (s - 1) k, side by side: a GLU's first MLP weight [A; G] is split as A and G separately, so
each rank holds [A_r; G_r]. Which parameter is split how is read from the model (sharding.py).
"""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorSplit:
    """``dim`` None: replicated; else split along ``dim`` in blocks of ``stride`` (module docstring);
    ``vocabulary``: the rows are the padded vocabulary's."""

    dim: int | None
    stride: int = 1
    vocabulary: bool = False

    @property
    def replicated(self) -> bool:
        return self.dim is None


def split_partitions(full: torch.Tensor, split: TensorSplit, tp_size: int) -> list[torch.Tensor]:
    """The ``tp_size`` partitions of ``full``: [n] along the split dim -> k tensors of [n / k]."""
    if split.replicated:
        return [full.clone() for _ in range(tp_size)]
    length = full.shape[split.dim]
    if length % (tp_size * split.stride):
        raise ValueError(f"dimension {split.dim} of size {length} does not split into {tp_size} partitions "
                         f"of {split.stride} equal blocks")
    blocks = torch.split(full, length // (tp_size * split.stride), dim=split.dim)
    return [torch.cat(blocks[rank::tp_size], dim=split.dim).clone() for rank in range(tp_size)]


def merge_partitions(partitions: list[torch.Tensor], split: TensorSplit) -> torch.Tensor:
    """The full tensor of ``partitions`` (rank order): the inverse of split_partitions. Replicated
    copies are averaged, as DeepSpeed's universal checkpoint does (identical copies stay exact)."""
    if split.replicated:
        return torch.stack([p.float() for p in partitions]).mean(dim=0).to(partitions[0].dtype)
    # rank r's partition holds blocks r, r + k, ...: interleave the blocks back into order
    per_rank = [torch.chunk(partition, split.stride, dim=split.dim) for partition in partitions]
    return torch.cat([blocks[j] for j in range(split.stride) for blocks in per_rank], dim=split.dim)


def replica_drift(partitions: list[torch.Tensor]) -> float:
    """Largest |difference| between a replicated parameter's copy on rank 0 and on any other rank."""
    reference = partitions[0].float()
    return max((float((p.float() - reference).abs().max()) for p in partitions[1:]), default=0.0)
