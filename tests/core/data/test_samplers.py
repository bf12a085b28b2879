"""Data-parallel samplers: exactly-once coverage across ranks and exact resume."""
import itertools

import pytest

from megatron.core.data.samplers import (MegatronPretrainingRandomSampler,
                                         MegatronPretrainingSampler, SamplerConfigError)


def rank_batches(sampler_class, world, *args, **kwargs):
    """Batches of every DP rank: {rank: [batch, ...]} for sampler_class(total, consumed, mbs, r, dp)."""
    total, consumed, mbs = args
    return {r: list(sampler_class(total, consumed, mbs, r, world, **kwargs)) for r in range(world)}


@pytest.mark.parametrize("total,mbs,dp", [(100, 3, 4), (64, 4, 2), (7, 1, 7), (10, 2, 1)])
def test_single_sampler_covers_each_sample_once_per_global_batch(total, mbs, dp):
    batches = rank_batches(MegatronPretrainingSampler, dp, total, 0, mbs)
    steps = total // (mbs * dp)
    for r in range(dp):
        assert len(batches[r]) == steps == len(MegatronPretrainingSampler(total, 0, mbs, r, dp))
    served = []
    for step in range(steps):
        global_batch = [i for r in range(dp) for i in batches[r][step]]
        # Global micro-batch `step` is the next mbs*dp consecutive samples, rank-major.
        assert global_batch == list(range(step * mbs * dp, (step + 1) * mbs * dp))
        served += global_batch
    assert sorted(served) == list(range(steps * mbs * dp))


def test_single_sampler_keeps_the_tail_without_drop_last():
    # 20 samples, global micro-batch 9: two full ones, then [18, 19] all on rank 0.
    batches = rank_batches(MegatronPretrainingSampler, 3, 20, 0, 3, drop_last=False)
    assert batches[0][-1] == [18, 19]
    assert [len(batches[r]) for r in range(3)] == [3, 2, 2]
    assert [len(MegatronPretrainingSampler(20, 0, 3, r, 3, drop_last=False)) for r in range(3)] == [3, 2, 2]
    served = sorted(i for r in range(3) for b in batches[r] for i in b)
    assert served == list(range(20))


@pytest.mark.parametrize("consumed_batches", [0, 1, 5, 12])
def test_single_sampler_resume_yields_the_same_next_batches(consumed_batches):
    mbs, dp, total = 2, 3, 90
    for r in range(dp):
        full = list(MegatronPretrainingSampler(total, 0, mbs, r, dp))
        resumed = list(MegatronPretrainingSampler(total, consumed_batches * mbs * dp, mbs, r, dp))
        assert resumed == full[consumed_batches:]


def epoch_batches(sampler):
    return list(iter(sampler))


@pytest.mark.parametrize("total,mbs,dp", [(100, 3, 4), (64, 4, 2), (30, 5, 3)])
def test_random_sampler_covers_an_epoch_exactly_once(total, mbs, dp):
    samplers = [MegatronPretrainingRandomSampler(total, 0, mbs, r, dp, seed=17) for r in range(dp)]
    per_epoch = (total // (mbs * dp)) * mbs * dp
    previous = None
    for _ in range(3):
        lengths = [len(s) for s in samplers]
        batches = [epoch_batches(s) for s in samplers]
        assert [len(b) for b in batches] == lengths
        served = [i for rank in batches for b in rank for i in b]
        assert all(len(b) == mbs for rank in batches for b in rank)
        assert sorted(served) == list(range(per_epoch))
        assert served != previous  # a new permutation every epoch
        previous = served
    assert all(s.consumed_samples == 3 * per_epoch for s in samplers)


def test_random_sampler_resume_matches_uninterrupted_run_across_epochs():
    total, mbs, dp, seed = 50, 2, 3, 5
    for r in range(dp):
        uninterrupted = MegatronPretrainingRandomSampler(total, 0, mbs, r, dp, seed)
        stream = list(itertools.chain(*(epoch_batches(uninterrupted) for _ in range(3))))
        for consumed_batches in (0, 3, 8, 11):
            resumed = MegatronPretrainingRandomSampler(total, consumed_batches * mbs * dp, mbs, r,
                                                       dp, seed)
            continued = list(itertools.chain(*(epoch_batches(resumed) for _ in range(2))))
            assert continued == stream[consumed_batches:consumed_batches + len(continued)]


def test_random_sampler_order_depends_on_seed():
    a = epoch_batches(MegatronPretrainingRandomSampler(40, 0, 4, 0, 1, seed=1))
    b = epoch_batches(MegatronPretrainingRandomSampler(40, 0, 4, 0, 1, seed=2))
    assert a != b and sorted(sum(a, [])) == sorted(sum(b, []))


@pytest.mark.parametrize("args,message", [
    ((0, 0, 1, 0, 1), "total_samples"),
    ((10, -1, 1, 0, 1), "consumed_samples"),
    ((10, 0, 0, 0, 1), "micro_batch_size"),
    ((10, 0, 1, 2, 2), "data_parallel_rank 2 must be < data_parallel_size 2"),
    ((10, 10, 1, 0, 1), "no samples left"),
])
def test_single_sampler_validation(args, message):
    with pytest.raises(SamplerConfigError, match=message):
        MegatronPretrainingSampler(*args)


def test_random_sampler_validation():
    with pytest.raises(SamplerConfigError, match="multiple of"):
        MegatronPretrainingRandomSampler(40, 3, 2, 0, 2, seed=0)
    with pytest.raises(SamplerConfigError, match="smaller than one global micro-batch"):
        MegatronPretrainingRandomSampler(3, 0, 2, 0, 2, seed=0)
    with pytest.raises(SamplerConfigError, match="seed"):
        MegatronPretrainingRandomSampler(40, 0, 2, 0, 2, seed=-1)
