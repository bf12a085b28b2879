"""megatron/training/log_reader.py reads back the lines the trainer prints: the lines here are made by
the trainer's own formatting functions (megatron/training/metrics.py), then parsed; expected values
are the printed figures, rounded as their formats round them."""
import math

import pytest

from megatron.training.log_reader import (iteration_records, parse_iteration_line,
                                          parse_validation_line, read_log, validation_records)
from megatron.training.metrics import (TEST_END_PREFIX, VALIDATION_END_PREFIX, LossAccumulator, RunTotals,
                                       TrainingLogFields, datetime_line, memory_report_line,
                                       parameter_count_lines, run_summary_lines, saved_checkpoint_line,
                                       saving_checkpoint_line, skipped_iterations_line, training_log_line,
                                       validation_log_lines, validation_prefix)

LAUNCHER_PREFIXES = ("", "[default0]:", "[default3]: ", "0: ", "[1,0]<stdout>:", "worker-1: ")
# docs/logging.md's field order of a line with every optional field.
ALL_FIELD_NAMES = ["consumed samples", "consumed tokens", "elapsed time per iteration (s)", "learning rate",
                   "global batch size", "lm loss", "loss scale", "grad norm", "num zeros", "params norm",
                   "curriculum seqlen", "number of skipped iterations", "number of nan iterations",
                   "samples per second", "TFLOPs", "model TFLOP/s", "MFU", "ETA"]


def log_fields(iteration: int = 1200, **changes) -> TrainingLogFields:
    values = dict(iteration=iteration, train_iters=300000, consumed_samples=512 * iteration,
                  consumed_tokens=512 * 2048 * iteration, elapsed_time_per_iteration=1.2468,
                  learning_rate=5.9e-5, global_batch_size=512, skipped_iterations=0, nan_iterations=0,
                  samples_per_second=410.65432, tflops=123.4567, losses={"lm loss": 2.3456789},
                  loss_scale=4096.0, grad_norm=0.34567, num_zeros=12.0, params_norm=271.8281,
                  curriculum_seqlen=256, model_tflops=98.7654, mfu=0.13254, eta_seconds=365025.4)
    values.update(changes)
    return TrainingLogFields(**values)


def test_every_field_of_a_full_line_is_read_as_printed():
    record = parse_iteration_line(training_log_line(log_fields()), line_number=7)
    assert (record.iteration, record.train_iters, record.line_number) == (1200, 300000, 7)
    assert list(record.fields) == ALL_FIELD_NAMES
    assert record.integer("consumed samples") == 614400
    assert record.integer("consumed tokens") == 1258291200
    assert record.number("elapsed time per iteration (s)") == 1.25
    assert record.number("learning rate") == 5.9e-5
    assert record.integer("global batch size") == 512
    assert record.number("lm loss") == 2.345679
    assert (record.number("loss scale"), record.number("grad norm")) == (4096.0, 0.346)
    assert (record.number("num zeros"), record.number("params norm")) == (12.0, 271.828)
    assert record.integer("curriculum seqlen") == 256
    assert (record.integer("number of skipped iterations"), record.integer("number of nan iterations")) == (0, 0)
    assert (record.number("samples per second"), record.number("TFLOPs")) == (410.654, 123.46)
    assert (record.number("model TFLOP/s"), record.number("MFU")) == (98.77, 13.25)
    assert record.fields["ETA"] == "101:23:45"  # 365025 s
    assert record.text == training_log_line(log_fields())


@pytest.mark.parametrize("prefix", LAUNCHER_PREFIXES)
def test_launcher_prefixes_are_skipped(prefix):
    line = training_log_line(log_fields(iteration=10, train_iters=100))
    record = parse_iteration_line(prefix + line)
    assert (record.iteration, record.train_iters) == (10, 100)
    assert record.fields == parse_iteration_line(line).fields
    assert record.text == line
    evaluation = parse_validation_line(prefix + validation_log_lines(validation_prefix(10), {"lm loss": 3.0})[1])
    assert (evaluation.set_name, evaluation.iteration, evaluation.loss) == ("validation", 10, 3.0)


def test_nan_and_inf_values_read_back():
    line = training_log_line(log_fields(losses={"lm loss": math.inf}, grad_norm=math.nan, loss_scale=math.inf))
    record = parse_iteration_line(line)
    assert (record.fields["lm loss"], record.fields["grad norm"]) == ("INF", "nan")
    assert record.number("lm loss") == math.inf and record.number("loss scale") == math.inf
    assert math.isnan(record.number("grad norm"))
    evaluation = parse_validation_line(validation_log_lines(validation_prefix(4), {"lm loss": math.nan})[1])
    assert math.isnan(evaluation.loss)
    assert evaluation.ppl == float(f"{math.exp(20.0):.6E}")  # PPL = exp(min(20, loss)): min(20, nan) is 20


def test_an_interval_of_skipped_iterations_has_counts_and_no_loss():
    interval = LossAccumulator()
    interval.add({"lm loss": 9.0}, skipped=True, nan=True)
    interval.add({"lm loss": 9.0}, skipped=True, nan=False)
    interval.add({"lm loss": 9.0}, skipped=True, nan=True)
    line = training_log_line(log_fields(losses=interval.averages(), skipped_iterations=interval.skipped_iterations,
                                        nan_iterations=interval.nan_iterations, grad_norm=None))
    record = parse_iteration_line("[default0]:" + line, line_number=3)
    assert record.integer("number of skipped iterations") == 3
    assert record.integer("number of nan iterations") == 2
    assert "lm loss" not in record.fields and "grad norm" not in record.fields
    with pytest.raises(ValueError, match=r"line 3: the log line has no 'lm loss' field"):
        record.number("lm loss")


def test_megatron_deepspeed_millisecond_lines_are_read():
    line = training_log_line(log_fields()).replace("elapsed time per iteration (s): 1.25",
                                                   "elapsed time per iteration (ms): 1246.8")
    assert parse_iteration_line(line).number("elapsed time per iteration (ms)") == 1246.8


def test_lines_that_are_not_iteration_or_evaluation_lines_are_ignored():
    totals = RunTotals(iterations=5, samples=20, tokens=1280, model_flops=1e12, seconds=10.0)
    others = [saving_checkpoint_line(1000, "ckpt"), saved_checkpoint_line(1000, "ckpt"),
              skipped_iterations_line(1001, 1200), memory_report_line(0, 100), datetime_line("after training is done"),
              *parameter_count_lines(1.3, 1.2), "",
              *run_summary_lines(totals, 5, 20, 1280, {"train lm loss": 2.0, "validation lm loss": 2.1}, 1, None),
              " iteration       10/     100 | learning rate: 1.000E-04 |",  # no consumed samples: not the trainer's
              "validation loss at iteration 10 | lm loss value: 2.0 |",  # cut short
              validation_log_lines(validation_prefix(10), {"lm loss": 2.0})[0]]
    log = read_log("\n".join(others))
    assert log.iterations == [] and log.validations == []


def test_a_field_that_is_not_a_number_names_the_line():
    record = parse_iteration_line(" iteration        1/      10 | consumed samples:   abc | lm loss: 1.0 |", 12)
    with pytest.raises(ValueError, match=r"line 12: field 'consumed samples' is not an integer"):
        record.integer("consumed samples")
    assert record.number("lm loss") == 1.0


def test_validation_lines_during_training_and_of_named_sets():
    loss = 2.3456784
    during = parse_validation_line(validation_log_lines(validation_prefix(1000), {"lm loss": loss})[1], 5)
    assert (during.kind, during.set_name, during.iteration, during.end_of_training) == ("validation", "validation",
                                                                                      1000, False)
    assert during.loss == 2.345678 and during.ppl == float(f"{math.exp(loss):.6E}")
    assert during.prefix == "validation loss at iteration 1000" and during.line_number == 5
    named = parse_validation_line(validation_log_lines(validation_prefix(40), {"lm loss": 1.5}, "valid-en_2.x")[1])
    assert (named.kind, named.set_name, named.iteration, named.loss) == ("validation", "valid-en_2.x", 40, 1.5)


def full_log(summary: bool) -> str:
    """Iterations 10 and 20 (train-iters 25), an evaluation at 20, the end-of-training evaluations of a
    validation set, a named test set and the unnamed test set, and the summary at iteration 25."""
    lines = ["[default0]:> building train, validation, and test datasets ...",
             "[default1]:" + training_log_line(log_fields(10, train_iters=25)),
             "[default1]:" + training_log_line(log_fields(20, train_iters=25, losses={"lm loss": 2.0})),
             *["[default1]:" + line for line in validation_log_lines(validation_prefix(20), {"lm loss": 2.5})],
             *validation_log_lines(VALIDATION_END_PREFIX, {"lm loss": 2.25}),
             *validation_log_lines(TEST_END_PREFIX, {"lm loss": 2.75}, "test-en"),
             *validation_log_lines(TEST_END_PREFIX, {"lm loss": 2.5})]
    if summary:
        lines += run_summary_lines(RunTotals(25, 100, 6400, 1e12, 5.0), 25, 100, 6400, {"train lm loss": 2.0}, 2, None)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("summary, end_iteration", [(True, 25), (False, 20)])
def test_read_log_places_the_end_of_training_evaluations(summary, end_iteration):
    """At the summary's iteration; without a summary (a log cut short), at the last iteration line."""
    text = full_log(summary)
    log = read_log(text)
    assert [(r.iteration, r.line_number) for r in log.iterations] == [(10, 2), (20, 3)]
    assert log.iterations[1].number("lm loss") == 2.0
    found = [(v.kind, v.set_name, v.iteration, v.loss, v.end_of_training) for v in log.validations]
    assert found == [("validation", "validation", 20, 2.5, False),
                     ("validation", "validation", end_iteration, 2.25, True),
                     ("test", "test-en", end_iteration, 2.75, True),
                     ("test", "validation", end_iteration, 2.5, True)]
    assert log.validations[1].prefix == "validation loss at " + VALIDATION_END_PREFIX
    assert iteration_records(text) == log.iterations
    assert validation_records(text) == log.validations


def test_an_evaluation_before_any_iteration_line_has_no_iteration():
    record = validation_records("\n".join(validation_log_lines(VALIDATION_END_PREFIX, {"lm loss": 2.0})))[0]
    assert record.iteration is None and record.end_of_training

