"""Data-parallel batch samplers that resume from a number of consumed samples.

Both yield, on each data-parallel rank, lists of `micro_batch_size` (m) sample ids, one list per
micro-batch. A *global micro-batch* is m * dp samples, of which DP rank r takes the r-th block of
m. ``consumed_samples`` counts samples over all DP ranks (the trainer's
``consumed_train_samples``), so a sampler rebuilt with the count saved in a checkpoint yields
exactly the batches the uninterrupted run would have yielded next.

* MegatronPretrainingSampler ("single"): global micro-batch j is the consecutive ids
  [c + j*m*dp, c + (j+1)*m*dp) with c = consumed_samples; rank r gets
  [c + j*m*dp + r*m, c + j*m*dp + (r+1)*m). The dataset's own shuffle_idx provides randomness.
* MegatronPretrainingRandomSampler ("cyclic"): epochs of P = floor(total / (m*dp)) * m*dp
  samples; rank r owns the bucket [r*P/dp, (r+1)*P/dp), visited in the order of a permutation
  seeded with ``seed + epoch``; every id in [0, P) is served exactly once per epoch.
"""
import numbers

import torch


class SamplerConfigError(ValueError):
    """Invalid sampler arguments; the message names the argument and its value."""


def _check_common(total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                  data_parallel_size):
    for name, value, minimum in (("total_samples", total_samples, 1),
                                 ("consumed_samples", consumed_samples, 0),
                                 ("micro_batch_size", micro_batch_size, 1),
                                 ("data_parallel_size", data_parallel_size, 1),
                                 ("data_parallel_rank", data_parallel_rank, 0)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
            raise SamplerConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if data_parallel_rank >= data_parallel_size:
        raise SamplerConfigError(
            f"data_parallel_rank {data_parallel_rank} must be < data_parallel_size "
            f"{data_parallel_size}")


class MegatronPretrainingSampler:
    """Sequential batches from `consumed_samples` on; one pass over [consumed, total).

    With ``drop_last`` (default) a trailing incomplete global micro-batch is dropped; otherwise
    each rank gets its part of it, and ranks whose part is empty get no final batch.
    """

    def __init__(self, total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                 data_parallel_size, drop_last=True):
        _check_common(total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                      data_parallel_size)
        if consumed_samples >= total_samples:
            raise SamplerConfigError(
                f"no samples left: consumed_samples {consumed_samples} >= total_samples "
                f"{total_samples}")
        self.total_samples = int(total_samples)
        self.consumed_samples = int(consumed_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.data_parallel_rank = int(data_parallel_rank)
        self.global_micro_batch = int(micro_batch_size * data_parallel_size)
        self.drop_last = drop_last

    def _tail(self):
        """Ids of this rank's part of the trailing incomplete global micro-batch."""
        start = self.total_samples - (self.total_samples - self.consumed_samples) % self.global_micro_batch
        first = start + self.data_parallel_rank * self.micro_batch_size
        return list(range(first, min(first + self.micro_batch_size, self.total_samples)))

    def __len__(self):
        full = (self.total_samples - self.consumed_samples) // self.global_micro_batch
        return full + (0 if self.drop_last or not self._tail() else 1)

    def __iter__(self):
        start = self.consumed_samples
        while start + self.global_micro_batch <= self.total_samples:
            first = start + self.data_parallel_rank * self.micro_batch_size
            yield list(range(first, first + self.micro_batch_size))
            start += self.global_micro_batch
        tail = self._tail()
        if not self.drop_last and tail:
            yield tail


class MegatronPretrainingRandomSampler:
    """Shuffled batches, one epoch per ``iter()``; iterating again continues with the next epoch.

    ``consumed_samples`` must be a multiple of m * dp; it advances by m * dp per yielded batch,
    so ``iter()`` after an exhausted pass starts the next epoch (the "cyclic" loader).
    """

    def __init__(self, total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                 data_parallel_size, seed):
        _check_common(total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
                      data_parallel_size)
        global_micro_batch = int(micro_batch_size * data_parallel_size)
        if total_samples < global_micro_batch:
            raise SamplerConfigError(
                f"total_samples {total_samples} is smaller than one global micro-batch "
                f"(micro_batch_size * data_parallel_size = {global_micro_batch})")
        if consumed_samples % global_micro_batch != 0:
            raise SamplerConfigError(
                f"consumed_samples {consumed_samples} must be a multiple of micro_batch_size * "
                f"data_parallel_size = {global_micro_batch}")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise SamplerConfigError(f"seed must be a non-negative integer, got {seed!r}")
        self.total_samples = int(total_samples)
        self.consumed_samples = int(consumed_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.data_parallel_rank = int(data_parallel_rank)
        self.data_parallel_size = int(data_parallel_size)
        self.global_micro_batch = global_micro_batch
        self.seed = int(seed)
        self.samples_per_epoch = (total_samples // global_micro_batch) * global_micro_batch

    def __len__(self):
        """Batches left in the current epoch for this rank."""
        in_epoch = self.consumed_samples % self.samples_per_epoch
        return (self.samples_per_epoch - in_epoch) // self.global_micro_batch

    def __iter__(self):
        epoch, in_epoch = divmod(self.consumed_samples, self.samples_per_epoch)
        bucket_size = self.samples_per_epoch // self.data_parallel_size
        bucket_start = self.data_parallel_rank * bucket_size
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        order = torch.randperm(bucket_size, generator=generator)
        # Each earlier global micro-batch took micro_batch_size ids from every rank's bucket.
        done_in_bucket = in_epoch // self.data_parallel_size
        for first in range(done_in_bucket, bucket_size, self.micro_batch_size):
            batch = order[first:first + self.micro_batch_size] + bucket_start
            self.consumed_samples += self.global_micro_batch
            yield batch.tolist()
