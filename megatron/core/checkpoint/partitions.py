"""How each parameter of the GPT model is spread over the ranks of a tensor-parallel group, and the
merge and split between one full tensor and its k partitions.

A parameter is either replicated (every rank holds all of it: LayerNorms, the position table, the
biases of the row-parallel layers) or split along one dimension d into k partitions. With stride s
the dimension is cut into k * s blocks and rank r holds blocks r, r + k, ..., r + (s - 1) k, side by
side: a GLU's first MLP weight [A; G] is split as A and G separately, so each rank holds [A_r; G_r].

    column-parallel  query_key_value, dense_h_to_4h (weight and bias)  d = 0   ([out, in] weights)
    row-parallel     self_attention.dense, dense_4h_to_h (weight)       d = 1
    vocabulary       word_embeddings.weight                              d = 0   (rows of the padded vocabulary)

The fused QKV weight is ordered per head ([heads, 3, head_dim] rows), so a split at head boundaries
is a plain split of dimension 0: the k partitions hold k consecutive groups of heads.
"""
from dataclasses import dataclass

import torch

COLUMN_PARALLEL = ("self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
                   "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias")
ROW_PARALLEL = ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")
VOCABULARY = ("word_embeddings.weight",)
GLU_STRIDED = ("mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias")


@dataclass(frozen=True)
class TensorSplit:
    """``dim`` None: replicated; else split along ``dim`` in blocks of ``stride`` (module docstring)."""

    dim: int | None
    stride: int = 1
    vocabulary: bool = False

    @property
    def replicated(self) -> bool:
        return self.dim is None


def tensor_split(name: str, glu: bool = False) -> TensorSplit:
    """How the parameter ``name`` (a key of a layer's state dict, with or without a module prefix) is
    split; ``glu``: the MLP is gated (--glu-activation), its first weight holds two halves."""
    if name.endswith(VOCABULARY):
        return TensorSplit(0, vocabulary=True)
    if name.endswith(COLUMN_PARALLEL):
        return TensorSplit(0, stride=2 if glu and name.endswith(GLU_STRIDED) else 1)
    if name.endswith(ROW_PARALLEL):
        return TensorSplit(1)
    return TensorSplit(None)


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
