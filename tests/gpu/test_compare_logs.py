"""tests/gpu/compare_logs.py reads the trainer's own log lines and fails on what it must catch."""
from megatron.training.metrics import (TrainingLogFields, loaded_checkpoint_line, saved_checkpoint_line,
                                       training_log_line)
from tests.gpu.compare_logs import compare_layouts, compare_resume, main, parse_steps


def log_line(iteration: int, loss: float, grad_norm: float = 2.0, lr: float | None = None) -> str:
    fields = TrainingLogFields(iteration=iteration, train_iters=60, consumed_samples=16 * iteration,
                               consumed_tokens=32768 * iteration, elapsed_time_per_iteration=0.95,
                               learning_rate=1e-4 / iteration if lr is None else lr, global_batch_size=16,
                               skipped_iterations=0, nan_iterations=0, samples_per_second=16.8, tflops=370.0,
                               losses={"lm loss": loss}, grad_norm=grad_norm, model_tflops=372.0, mfu=0.47)
    return "[Rank 0] noise\n" + training_log_line(fields)


def log(losses: dict[int, float], **kwargs) -> str:
    return "\n".join(log_line(iteration, loss, **kwargs) for iteration, loss in losses.items())


def test_parse_steps_reads_every_field_of_the_trainer_line():
    steps = parse_steps(log_line(7, 6.954314, grad_norm=1.478, lr=6.891e-5))
    step = steps[7]
    assert (step.iteration, step.consumed_samples) == (7, 112)
    assert step.learning_rate == 6.891e-5
    assert step.loss == 6.954314 and step.grad_norm == 1.478


def test_layouts_within_tolerance_pass_and_outside_fail():
    reference = parse_steps(log({1: 11.5, 2: 11.4, 3: 20.0}))
    close = parse_steps(log({1: 11.5, 2: 11.4001, 3: 20.0}))
    far = parse_steps(log({1: 11.5, 2: 11.6, 3: 20.0}))
    assert compare_layouts({"a": reference, "b": close}, 1e-4, 3)[1]
    assert not compare_layouts({"a": reference, "b": far}, 1e-4, 3)[1]
    # a difference after the checked iterations is reported but does not fail
    assert compare_layouts({"a": reference, "b": far}, 1e-4, 1)[1]


def test_layouts_fail_when_a_run_stopped_early():
    reference = parse_steps(log({1: 11.5, 2: 11.4}))
    short = parse_steps(log({1: 11.5}))
    lines, ok = compare_layouts({"a": reference, "b": short}, 1e-2, 2)
    assert not ok and "b has no iteration 2" in lines[-1]


def test_resume_passes_when_counters_match_and_losses_agree():
    reference = parse_steps(log({i: 10.0 - 0.1 * i for i in range(1, 7)}))
    saved = log({i: 10.0 - 0.1 * i for i in range(1, 4)}) + "\n" + saved_checkpoint_line(3, "/ckpt")
    resumed = loaded_checkpoint_line("/ckpt", 3) + "\n" + log({i: 10.0 - 0.1 * i for i in range(4, 7)})
    lines, ok = compare_resume(reference, saved, resumed, 1e-6)
    assert ok, lines


def test_resume_fails_on_a_wrong_learning_rate_or_a_gap():
    reference = parse_steps(log({i: 10.0 for i in range(1, 7)}))
    saved = saved_checkpoint_line(3, "/ckpt")
    wrong_lr = loaded_checkpoint_line("/ckpt", 3) + "\n" + log({i: 10.0 for i in range(4, 7)}, lr=1e-4)
    lines, ok = compare_resume(reference, saved, wrong_lr, 1e-6)
    assert not ok and "COUNTERS DIFFER" in "\n".join(lines)
    gap = loaded_checkpoint_line("/ckpt", 3) + "\n" + log({i: 10.0 for i in range(5, 7)})
    assert not compare_resume(reference, saved, gap, 1e-6)[1]


def test_resume_fails_without_a_loaded_checkpoint_line():
    reference = parse_steps(log({i: 10.0 for i in range(1, 5)}))
    lines, ok = compare_resume(reference, saved_checkpoint_line(2, "/ckpt"), log({3: 10.0, 4: 10.0}), 1e-6)
    assert not ok and "loaded at []" in lines[0]


def test_command_line_exit_status(tmp_path, capsys):
    (tmp_path / "a.log").write_text(log({1: 11.5, 2: 11.4}))
    (tmp_path / "b.log").write_text(log({1: 11.5, 2: 12.4}))
    arguments = ["layouts", "--tolerance", "1e-3", "--first", "2", str(tmp_path / "a.log"), str(tmp_path / "b.log")]
    assert main(arguments) == 1
    assert "FAIL" in capsys.readouterr().out
    assert main(arguments[:-1] + [str(tmp_path / "a.log")]) == 0
