"""Batch-size rampup against a hand-computed table, and Megatron-DeepSpeed's divisibility errors."""
import pytest

from megatron.training.microbatches import (BatchSizeError, build_num_microbatches_calculator,
                                            train_iters_for_samples)

# --rampup-batch-size 4 4 96, --global-batch-size 16, --micro-batch-size 2, DP 2 (b * d = 4).
# n_inc = (16 - 4) / 4 = 3, per_inc = 96 / 3 = 32 samples: gbs = 4 + 4 * floor(c / 32) while c <= 96.
# (iteration, consumed samples before it, global batch size, micro batches)
RAMP_TABLE = [
    (1, 0, 4, 1), (2, 4, 4, 1), (3, 8, 4, 1), (4, 12, 4, 1), (5, 16, 4, 1), (6, 20, 4, 1), (7, 24, 4, 1),
    (8, 28, 4, 1),
    (9, 32, 8, 2), (10, 40, 8, 2), (11, 48, 8, 2), (12, 56, 8, 2),
    (13, 64, 12, 3), (14, 76, 12, 3), (15, 88, 12, 3),
    (16, 100, 16, 4), (17, 116, 16, 4), (18, 132, 16, 4),
]


def test_rampup_follows_the_hand_computed_table():
    calculator = build_num_microbatches_calculator(16, 2, 2, rampup_batch_size=[4, 4, 96])
    consumed = 0
    for iteration, expected_consumed, expected_gbs, expected_micro_batches in RAMP_TABLE:
        calculator.update(consumed)
        assert (iteration, consumed, calculator.get_current_global_batch_size(), calculator.get()) == \
               (iteration, expected_consumed, expected_gbs, expected_micro_batches)
        consumed += calculator.get_current_global_batch_size()


def test_rampup_boundary_is_strictly_after_the_ramp_samples():
    calculator = build_num_microbatches_calculator(16, 2, 2, rampup_batch_size=[4, 4, 96])
    calculator.update(96)  # c <= ramp: 4 + 4 * floor(96 / 32) = 16
    assert calculator.get_current_global_batch_size() == 16
    calculator.update(95)
    assert calculator.get_current_global_batch_size() == 12


def test_train_iters_simulates_the_ramp():
    # The ramp takes 15 iterations and 100 samples (table), then (200 - 100) // 16 = 6 more.
    assert train_iters_for_samples(200, 16, 2, 2, rampup_batch_size=[4, 4, 96]) == 21
    assert train_iters_for_samples(211, 16, 2, 2, rampup_batch_size=[4, 4, 96]) == 21  # partial batch dropped
    assert train_iters_for_samples(212, 16, 2, 2, rampup_batch_size=[4, 4, 96]) == 22
    assert train_iters_for_samples(200, 16, 2, 2) == 12


def test_train_samples_ending_inside_the_ramp_count_whole_batches():
    # 8 iterations of 4 (32 samples) + 2 of 8 (48): the next batch of 8 would pass 50.
    assert train_iters_for_samples(50, 16, 2, 2, rampup_batch_size=[4, 4, 96]) == 10


def test_constant_batch():
    calculator = build_num_microbatches_calculator(32, 2, 4)
    calculator.update(12345)
    assert (calculator.get(), calculator.get_current_global_batch_size()) == (4, 32)


def test_start_equal_to_global_batch_is_a_constant_batch():
    calculator = build_num_microbatches_calculator(16, 2, 2, rampup_batch_size=[16, 4, 96])
    assert (calculator.get(), calculator.get_current_global_batch_size()) == (4, 16)
    assert train_iters_for_samples(200, 16, 2, 2, rampup_batch_size=[16, 4, 96]) == 12


def test_bigscience_tr11_ramp():
    # 192 16 9_765_625 with GBS 2048: 116 increments of 84,186.4 samples each.
    calculator = build_num_microbatches_calculator(2048, 2, 8, rampup_batch_size=[192, 16, 9_765_625])
    assert calculator.rampup_samples_per_increment == pytest.approx(9_765_625 / 116)
    calculator.update(84_187)
    assert calculator.get_current_global_batch_size() == 208
    calculator.update(9_765_626)
    assert calculator.get() == 128


@pytest.mark.parametrize("global_batch, micro_batch, dp, rampup, flags", [
    (18, 2, 2, None, ["--global-batch-size 18", "--micro-batch-size 2", "data-parallel size 2 = 4"]),
    (16, 2, 2, [4, 5, 96], ["--rampup-batch-size 4 5 96", "--global-batch-size 16", "whole <increment>s"]),
    (16, 2, 2, [20, 4, 96], ["--rampup-batch-size 20 4 96", "<start> <= 16"]),
    (16, 2, 2, [6, 2, 100], ["--rampup-batch-size 6 2 100", "data-parallel size 2 = 4", "these are not: 6, 10, 14"]),
    (16, 2, 2, [4, 4], ["--rampup-batch-size takes three values"]),
    (0, 2, 2, None, ["--global-batch-size must be a positive integer"]),
])
def test_static_errors_name_the_flags(global_batch, micro_batch, dp, rampup, flags):
    with pytest.raises(BatchSizeError) as raised:
        build_num_microbatches_calculator(global_batch, micro_batch, dp, rampup_batch_size=rampup)
    for flag in flags:
        assert flag in str(raised.value)


def test_ramp_batch_not_divisible_is_refused_before_training_starts():
    # start 6 is not a multiple of b * d = 4: no calculator and no iteration count for this ramp.
    with pytest.raises(BatchSizeError, match="--rampup-batch-size 6 2 100"):
        train_iters_for_samples(1000, 16, 2, 2, rampup_batch_size=[6, 2, 100])
