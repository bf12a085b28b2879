"""Number of micro batches per optimizer step, constant or ramped up with the consumed samples.

With B = --global-batch-size, b = --micro-batch-size, d = data-parallel size, the global batch of
an iteration is m * b * d, where m is the number of micro batches (gradient accumulation steps).

``--rampup-batch-size start inc ramp_samples`` (seed-system.md §6.2), with c the samples consumed
before the iteration:

    n_inc   = (B - start) / inc                 (must divide exactly)
    per_inc = ramp_samples / n_inc              (a float)
    gbs(c)  = B                                 if c > ramp_samples
            = start + floor(c / per_inc) * inc  otherwise
    m       = gbs(c) // (b * d)                 (gbs(c) must be a multiple of b * d)

``start == B`` (no increment) is accepted as a constant batch; the seed divides by zero there.
"""
import math

RAMPUP_FLAG = "--rampup-batch-size"


class BatchSizeError(ValueError):
    """Batch sizes that do not divide; the message names the flags."""


def _check_positive(value, flag):
    if not isinstance(value, int) or value < 1:
        raise BatchSizeError(f"{flag} must be a positive integer, got {value!r}")


def _check_global_batch(global_batch_size, micro_batch_size, data_parallel_size):
    _check_positive(global_batch_size, "--global-batch-size")
    _check_positive(micro_batch_size, "--micro-batch-size")
    _check_positive(data_parallel_size, "the data-parallel size")
    per_micro_batch = micro_batch_size * data_parallel_size
    if global_batch_size % per_micro_batch != 0:
        raise BatchSizeError(
            f"--global-batch-size ({global_batch_size}) is not divisible by --micro-batch-size "
            f"({micro_batch_size}) times the data-parallel size ({data_parallel_size}); "
            f"use a multiple of {per_micro_batch}")


class ConstantNumMicroBatches:
    """m = B / (b * d) for every iteration."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int):
        _check_global_batch(global_batch_size, micro_batch_size, data_parallel_size)
        self.global_batch_size = global_batch_size
        self.num_micro_batches = global_batch_size // (micro_batch_size * data_parallel_size)

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.global_batch_size

    def update(self, consumed_samples: int, consistency_check: bool = True):
        """Nothing changes with a constant batch."""


class RampupBatchsizeNumMicroBatches:
    """The global batch grows from ``start`` by ``increment`` every ramp_samples / n_inc samples."""

    def __init__(self, start_batch_size: int, batch_size_increment: int, rampup_samples: int,
                 global_batch_size: int, micro_batch_size: int, data_parallel_size: int):
        _check_global_batch(global_batch_size, micro_batch_size, data_parallel_size)
        _check_positive(start_batch_size, f"{RAMPUP_FLAG} <start>")
        _check_positive(batch_size_increment, f"{RAMPUP_FLAG} <increment>")
        if not isinstance(rampup_samples, int) or rampup_samples < 0:
            raise BatchSizeError(f"{RAMPUP_FLAG} <ramp samples> must be a non-negative integer, got {rampup_samples!r}")
        difference = global_batch_size - start_batch_size
        if difference < 0:
            raise BatchSizeError(f"{RAMPUP_FLAG} <start> ({start_batch_size}) must not exceed "
                                 f"--global-batch-size ({global_batch_size})")
        if difference % batch_size_increment != 0:
            raise BatchSizeError(
                f"--global-batch-size ({global_batch_size}) minus the {RAMPUP_FLAG} start ({start_batch_size}) "
                f"must be divisible by the {RAMPUP_FLAG} increment ({batch_size_increment})")
        self.start_batch_size = start_batch_size
        self.batch_size_increment = batch_size_increment
        self.rampup_samples = rampup_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        num_increments = difference // batch_size_increment
        self.rampup_samples_per_increment = rampup_samples / num_increments if num_increments else math.inf
        self.update(0, consistency_check=False)

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """gbs(c) of the module docstring."""
        if consumed_samples > self.rampup_samples:
            return self.global_batch_size
        steps = int(consumed_samples / self.rampup_samples_per_increment)
        return self.start_batch_size + steps * self.batch_size_increment

    def update(self, consumed_samples: int, consistency_check: bool = True):
        """Set the batch for an iteration that starts after ``consumed_samples`` samples.

        With ``consistency_check`` a batch that is not a multiple of b * d raises BatchSizeError.
        """
        self.current_global_batch_size = self.global_batch_size_at(consumed_samples)
        per_micro_batch = self.micro_batch_size * self.data_parallel_size
        if consistency_check and self.current_global_batch_size % per_micro_batch != 0:
            raise BatchSizeError(
                f"the ramped-up global batch size {self.current_global_batch_size} (after {consumed_samples} "
                f"consumed samples, {RAMPUP_FLAG} {self.start_batch_size} {self.batch_size_increment} "
                f"{self.rampup_samples}) is not divisible by --micro-batch-size ({self.micro_batch_size}) times "
                f"the data-parallel size ({self.data_parallel_size}); choose a start and increment that are "
                f"multiples of {per_micro_batch}")
        self.num_micro_batches = self.current_global_batch_size // per_micro_batch


def build_num_microbatches_calculator(global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                                      rampup_batch_size=None):
    """A constant calculator, or a ramp-up one for ``rampup_batch_size = (start, increment, ramp_samples)``."""
    if rampup_batch_size is None:
        return ConstantNumMicroBatches(global_batch_size, micro_batch_size, data_parallel_size)
    if len(rampup_batch_size) != 3:
        raise BatchSizeError(f"{RAMPUP_FLAG} takes three values: <start batch size> <batch size increment> "
                             f"<ramp-up samples>, got {list(rampup_batch_size)}")
    start, increment, samples = (int(v) for v in rampup_batch_size)
    return RampupBatchsizeNumMicroBatches(start, increment, samples, global_batch_size, micro_batch_size,
                                          data_parallel_size)


def train_iters_for_samples(train_samples: int, global_batch_size: int, micro_batch_size: int,
                            data_parallel_size: int, rampup_batch_size=None) -> int:
    """Iterations that consume --train-samples, dropping a partial last batch.

    Without rampup: train_samples // B. With rampup, as the seed: run the ramp while the consumed
    samples c <= ramp_samples (c += gbs(c), one iteration each), then add (train_samples - c) // B.
    When --train-samples ends inside the ramp (the seed then adds a negative count), only the
    iterations whose whole batch fits are counted. Every global batch of the ramp is checked
    against b * d here, so a ramp that would fail in the middle of training fails before it starts.
    """
    calculator = build_num_microbatches_calculator(global_batch_size, micro_batch_size, data_parallel_size,
                                                   rampup_batch_size)
    if rampup_batch_size is None:
        return train_samples // global_batch_size
    iterations = 0
    consumed = 0
    while consumed <= calculator.rampup_samples:
        calculator.update(consumed, consistency_check=True)
        batch = calculator.get_current_global_batch_size()
        if consumed + batch > train_samples:
            return iterations
        consumed += batch
        iterations += 1
    return iterations + (train_samples - consumed) // global_batch_size
