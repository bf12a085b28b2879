"""Number of micro batches per optimizer step, constant or ramped up with the consumed samples.

With B = --global-batch-size, b = --micro-batch-size, d = data-parallel size, the global batch of
an iteration is m * b * d, where m is the number of micro batches (gradient accumulation steps).

``--rampup-batch-size start inc ramp_samples`` (Megatron-DeepSpeed's rampup), with c the samples
consumed before the iteration:

    n_inc   = (B - start) / inc                 (must divide exactly)
    per_inc = ramp_samples / n_inc              (a float)
    gbs(c)  = B                                 if c > ramp_samples
            = start + floor(c / per_inc) * inc  otherwise
    m       = gbs(c) // (b * d)                 (gbs(c) must be a multiple of b * d)

``start == B`` (no increment) is accepted as a constant batch; Megatron-DeepSpeed divides by zero
there. check_batch_sizes holds every rule; the arguments' validation calls it too.
"""
import math

RAMPUP_FLAG = "--rampup-batch-size"


class BatchSizeError(ValueError):
    """Batch sizes that do not divide; the message names the flags."""


def _check_positive(value, flag):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BatchSizeError(f"{flag} must be a positive integer, got {value!r}")


def _check_rampup(rampup_batch_size, global_batch_size: int, micro_batch_size: int,
                  data_parallel_size: int) -> None:
    if len(rampup_batch_size) != 3:
        raise BatchSizeError(f"{RAMPUP_FLAG} takes three values: <start batch size> <batch size increment> "
                             f"<ramp-up samples>, got {list(rampup_batch_size)}")
    start, increment, ramp_samples = rampup_batch_size
    per_micro_batch = micro_batch_size * data_parallel_size
    named = f"{RAMPUP_FLAG} {start} {increment} {ramp_samples}"
    _check_positive(start, f"{RAMPUP_FLAG} <start>")
    _check_positive(increment, f"{RAMPUP_FLAG} <increment>")
    if isinstance(ramp_samples, bool) or not isinstance(ramp_samples, int) or ramp_samples < 0:
        raise BatchSizeError(f"{RAMPUP_FLAG} <ramp samples> must be a non-negative integer, got {ramp_samples!r}")
    if start > global_batch_size or (global_batch_size - start) % increment:
        raise BatchSizeError(f"{named}: the ramp must reach --global-batch-size {global_batch_size} from <start> "
                             f"in whole <increment>s (<start> <= {global_batch_size}, {global_batch_size} - "
                             f"<start> a multiple of <increment>)")
    bad = [size for size in range(start, global_batch_size + 1, increment) if size % per_micro_batch]
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        raise BatchSizeError(f"{named}: every global batch of the ramp must be a multiple of --micro-batch-size "
                             f"{micro_batch_size} x data-parallel size {data_parallel_size} = {per_micro_batch}; "
                             f"these are not: {shown}. Use <start> and <increment> multiples of {per_micro_batch}")


def check_batch_sizes(global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                      rampup_batch_size=None) -> None:
    """Every batch-size rule, in one place: B, b, d positive; B a multiple of b * d; with a rampup,
    B reached from start in whole increments and every global batch of the ramp a multiple of b * d
    (so no iteration of the ramp can fail later). Raises BatchSizeError naming the flags."""
    _check_positive(global_batch_size, "--global-batch-size")
    _check_positive(micro_batch_size, "--micro-batch-size")
    _check_positive(data_parallel_size, "the data-parallel size")
    per_micro_batch = micro_batch_size * data_parallel_size
    if global_batch_size % per_micro_batch:
        raise BatchSizeError(
            f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size {micro_batch_size} x "
            f"data-parallel size {data_parallel_size} = {per_micro_batch}: use a multiple of {per_micro_batch}")
    if rampup_batch_size is not None:
        _check_rampup(rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size)


class ConstantNumMicroBatches:
    """m = B / (b * d) for every iteration."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int):
        check_batch_sizes(global_batch_size, micro_batch_size, data_parallel_size)
        self.global_batch_size = global_batch_size
        self.num_micro_batches = global_batch_size // (micro_batch_size * data_parallel_size)

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.global_batch_size

    def update(self, consumed_samples: int):
        """Nothing changes with a constant batch."""


class RampupBatchsizeNumMicroBatches:
    """The global batch grows from ``start`` by ``increment`` every ramp_samples / n_inc samples."""

    def __init__(self, start_batch_size: int, batch_size_increment: int, rampup_samples: int,
                 global_batch_size: int, micro_batch_size: int, data_parallel_size: int):
        check_batch_sizes(global_batch_size, micro_batch_size, data_parallel_size,
                          (start_batch_size, batch_size_increment, rampup_samples))
        difference = global_batch_size - start_batch_size
        self.start_batch_size = start_batch_size
        self.batch_size_increment = batch_size_increment
        self.rampup_samples = rampup_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        num_increments = difference // batch_size_increment
        self.rampup_samples_per_increment = rampup_samples / num_increments if num_increments else math.inf
        self.update(0)

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

    def update(self, consumed_samples: int):
        """Set the batch for an iteration that starts after ``consumed_samples`` samples (a multiple
        of b * d: check_batch_sizes checked every batch of the ramp)."""
        self.current_global_batch_size = self.global_batch_size_at(consumed_samples)
        self.num_micro_batches = self.current_global_batch_size // (self.micro_batch_size * self.data_parallel_size)


def build_num_microbatches_calculator(global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                                      rampup_batch_size=None):
    """A constant calculator, or a ramp-up one for ``rampup_batch_size = (start, increment, ramp_samples)``."""
    if rampup_batch_size is None:
        return ConstantNumMicroBatches(global_batch_size, micro_batch_size, data_parallel_size)
    check_batch_sizes(global_batch_size, micro_batch_size, data_parallel_size, rampup_batch_size)
    start, increment, samples = rampup_batch_size
    return RampupBatchsizeNumMicroBatches(start, increment, samples, global_batch_size, micro_batch_size,
                                          data_parallel_size)


def train_iters_for_samples(train_samples: int, global_batch_size: int, micro_batch_size: int,
                            data_parallel_size: int, rampup_batch_size=None) -> int:
    """Iterations that consume --train-samples, dropping a partial last batch.

    Without rampup: train_samples // B. With rampup, as Megatron-DeepSpeed: run the ramp while the
    consumed samples c <= ramp_samples (c += gbs(c), one iteration each), then add
    (train_samples - c) // B. When --train-samples ends inside the ramp (Megatron-DeepSpeed then adds
    a negative count), only the iterations whose whole batch fits are counted.
    """
    calculator = build_num_microbatches_calculator(global_batch_size, micro_batch_size, data_parallel_size,
                                                   rampup_batch_size)
    if rampup_batch_size is None:
        return train_samples // global_batch_size
    iterations = 0
    consumed = 0
    while consumed <= calculator.rampup_samples:
        calculator.update(consumed)
        batch = calculator.get_current_global_batch_size()
        if consumed + batch > train_samples:
            return iterations
        consumed += batch
        iterations += 1
    return iterations + (train_samples - consumed) // global_batch_size
