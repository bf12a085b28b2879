"""Merge and split of tensor-parallel partitions: splitting agrees with how the layers slice a full
weight at initialization, and merge inverts split."""
import pytest
import torch

from megatron.core.checkpoint.partitions import TensorSplit, merge_partitions, replica_drift, split_partitions
from megatron.core.tensor_parallel.layers import _slice_of_master


@pytest.mark.parametrize("dim,stride,tp_size", [(0, 1, 2), (0, 2, 2), (1, 1, 4), (0, 2, 4), (1, 1, 1)])
def test_split_matches_the_layers_slicing_and_merge_inverts_it(dim, stride, tp_size):
    full = torch.randn(16, 24)
    split = TensorSplit(dim, stride)
    partitions = split_partitions(full, split, tp_size)
    for rank, partition in enumerate(partitions):
        torch.testing.assert_close(partition, _slice_of_master(full, dim, stride, rank, tp_size), rtol=0, atol=0)
    torch.testing.assert_close(merge_partitions(partitions, split), full, rtol=0, atol=0)


def test_glu_halves_are_split_separately():
    value, gate = torch.arange(8.0), torch.arange(100.0, 108.0)
    partitions = split_partitions(torch.cat([value, gate]), TensorSplit(0, stride=2), 2)
    assert partitions[0].tolist() == [0, 1, 2, 3, 100, 101, 102, 103]
    assert partitions[1].tolist() == [4, 5, 6, 7, 104, 105, 106, 107]


def test_replicated_copies_are_averaged_and_their_drift_reported():
    copies = [torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])]
    torch.testing.assert_close(merge_partitions(copies, TensorSplit(None)), torch.tensor([1.0, 2.25]))
    assert replica_drift(copies) == 0.5
    assert replica_drift([torch.ones(3)]) == 0.0


def test_a_dimension_that_does_not_split_evenly_is_refused():
    with pytest.raises(ValueError, match="dimension 0 of size 6 does not split into 4 partitions"):
        split_partitions(torch.zeros(6, 2), TensorSplit(0), 4)
