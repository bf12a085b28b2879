"""tools/plot_logs.py: a log file made of the trainer's own lines (megatron/training/metrics.py) and a
TensorBoard directory written by the trainer's own writer (megatron/training/tb_logger.py) are
plotted together; the drawn data must be the values written (rounded as the log line prints them,
or to float32 as TensorBoard stores them), and every PNG a valid PNG."""
import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from megatron.training.metrics import (VALIDATION_END_PREFIX, RunTotals, TrainingLogFields, run_summary_lines,
                                       saved_checkpoint_line, training_log_line, validation_log_lines,
                                       validation_prefix)
from megatron.training.throughput import Throughput
from megatron.training.tb_logger import IterationScalars, Progress, TensorBoardLogger, TensorBoardSettings
from tests.conftest import REPO_ROOT
from tools.plot_logs import (MATPLOTLIB_MISSING, draw_series, load_run, main, series_points,
                             validation_points)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ITERATIONS = list(range(1, 13))
EVALUATED_AT = (4, 8)
TRAIN_ITERS = 12
SERIES = ("loss", "lr", "grad-norm", "throughput")


def loss_at(i):
    return 10.0 / (1.0 + 0.37 * i)


def lr_at(i):
    return 1e-4 * i / TRAIN_ITERS


def grad_norm_at(i):
    return 3.0 + 0.123456 * i


def samples_per_second_at(i):
    return 40.0 + 1.23456 * i


def validation_loss_at(i):
    return loss_at(i) + 0.5


def log_text() -> str:
    """Iterations 1-12 under a torchrun prefix, evaluations at 4 and 8 and at the end, the summary;
    iteration 7 is logged twice (a resume from iteration 6): the second line holds."""
    lines = ["[default0]:training ..."]
    for index, i in enumerate(ITERATIONS[:7] + [7] + ITERATIONS[7:]):
        superseded = index == 6  # the first line of iteration 7, before the resume
        loss = loss_at(i) + (1.0 if superseded else 0.0)
        fields = TrainingLogFields(iteration=i, train_iters=TRAIN_ITERS, consumed_samples=4 * i,
                                   consumed_tokens=256 * i, elapsed_time_per_iteration=0.1, learning_rate=lr_at(i),
                                   global_batch_size=4, skipped_iterations=0, nan_iterations=0,
                                   samples_per_second=samples_per_second_at(i), tflops=0.01,
                                   losses={"lm loss": loss}, grad_norm=grad_norm_at(i))
        lines.append("[default1]:" + training_log_line(fields))
        if i in EVALUATED_AT:
            lines += ["[default1]:" + line
                      for line in validation_log_lines(validation_prefix(i), {"lm loss": validation_loss_at(i)})]
            lines.append("[default0]:" + saved_checkpoint_line(i, "ckpt"))
    lines += validation_log_lines(VALIDATION_END_PREFIX, {"lm loss": validation_loss_at(TRAIN_ITERS)})
    lines += run_summary_lines(RunTotals(12, 48, 3072, 1e9, 1.2), TRAIN_ITERS, 48, 3072, {}, 2, None)
    return "\n".join(lines) + "\n"


def write_tensorboard(directory: str, with_timers: bool = True) -> None:
    """The trainer's scalars for iterations 1-12, a validation set at 4 and 8 and a named set "en" at 8."""
    writer = TensorBoardLogger(TensorBoardSettings(str(directory), log_timers=with_timers), enabled=True)
    writer.write_run_start({"seed": 1234}, 0, 2)
    for i in ITERATIONS:
        progress = Progress(iteration=i, consumed_samples=4 * i, consumed_tokens=256 * i)
        writer.write_iteration(progress, IterationScalars(learning_rate=lr_at(i), global_batch_size=4,
                                                          losses={"lm loss": loss_at(i)}, grad_norm=grad_norm_at(i)))
        sps = samples_per_second_at(i)
        writer.write_throughput(progress, Throughput(iteration_time=4 / sps, samples_per_second=sps,
                                                     samples_per_second_per_replica=sps / 2,
                                                     tokens_per_second=64 * sps, tokens_per_second_per_replica=32 * sps,
                                                     tflops=0.01, model_tflops=0.01, mfu=None))
        if i in EVALUATED_AT:
            writer.write_validation(progress, {"lm loss": validation_loss_at(i)})
        if i == 8:
            writer.write_validation(progress, {"lm loss": 1.75}, group_name="en")
    writer.close()


def printed(value: float, spec: str) -> float:
    return float(format(value, spec))


def stored(value: float) -> float:
    """``value`` as TensorBoard keeps it (float32)."""
    return float(np.float32(value))


@pytest.fixture
def runs(tmp_path):
    log = tmp_path / "run_a.log"
    log.write_text(log_text())
    tensorboard = tmp_path / "run_b"
    write_tensorboard(tensorboard)
    return str(log), str(tensorboard)


def test_log_series_are_the_printed_values(runs):
    run = load_run(runs[0], "a")
    assert series_points([run], "loss") == {"a": (ITERATIONS, [printed(loss_at(i), ".6E") for i in ITERATIONS])}
    assert run.series["lr"] == (ITERATIONS, [printed(lr_at(i), ".3E") for i in ITERATIONS])
    assert run.series["grad-norm"] == (ITERATIONS, [printed(grad_norm_at(i), ".3f") for i in ITERATIONS])
    assert run.series["throughput"] == (ITERATIONS, [printed(samples_per_second_at(i), ".3f") for i in ITERATIONS])
    evaluated = list(EVALUATED_AT) + [TRAIN_ITERS]  # the end-of-training evaluation at the summary's iteration
    assert validation_points([run]) == {"a": {"validation": (evaluated, [printed(validation_loss_at(i), ".6E")
                                                                         for i in evaluated])}}


def test_tensorboard_series_are_the_written_values(runs):
    run = load_run(runs[1], "b")
    assert run.series["loss"] == (ITERATIONS, [stored(loss_at(i)) for i in ITERATIONS])
    assert run.series["lr"] == (ITERATIONS, [stored(lr_at(i)) for i in ITERATIONS])
    assert run.series["grad-norm"] == (ITERATIONS, [stored(grad_norm_at(i)) for i in ITERATIONS])
    assert run.series["throughput"] == (ITERATIONS, [stored(samples_per_second_at(i)) for i in ITERATIONS])
    assert run.validation == {"validation": (list(EVALUATED_AT), [stored(validation_loss_at(i)) for i in EVALUATED_AT]),
                              "en": ([8], [1.75])}


def drawn(figure) -> dict[str, tuple[list[float], list[float]]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in figure.axes[0].get_lines()}


def test_the_figure_draws_the_series_of_every_run(runs):
    loaded = [load_run(runs[0], "a"), load_run(runs[1], "b")]
    figure = draw_series(loaded, "loss")
    lines = drawn(figure)
    assert set(lines) == {"a", "b", "a validation loss", "b validation loss", "b en loss"}
    for label, (steps, values) in series_points(loaded, "loss").items():
        assert lines[label] == (steps, values)
    assert lines["b en loss"] == ([8], [1.75])
    colours = {line.get_label(): line.get_color() for line in figure.axes[0].get_lines()}
    assert colours["a"] == colours["a validation loss"] and colours["b"] == colours["b en loss"] != colours["a"]
    assert set(drawn(draw_series(loaded, "lr"))) == {"a", "b"}  # validation points only on the loss plot


def test_inf_is_drawn_as_a_gap_but_kept_in_the_series(tmp_path):
    lines = [training_log_line(TrainingLogFields(iteration=i, train_iters=3, consumed_samples=i, consumed_tokens=i,
                                                 elapsed_time_per_iteration=1.0, learning_rate=1e-4,
                                                 global_batch_size=1, skipped_iterations=0, nan_iterations=0,
                                                 samples_per_second=1.0, tflops=0.0, losses={"lm loss": loss}))
             for i, loss in ((1, 3.0), (2, math.inf), (3, 2.0))]
    (tmp_path / "x.log").write_text("\n".join(lines))
    run = load_run(str(tmp_path / "x.log"), "x")
    assert run.series["loss"] == ([1, 2, 3], [3.0, math.inf, 2.0])
    steps, values = drawn(draw_series([run], "loss"))["x"]
    assert steps == [1, 2, 3] and values[0] == 3.0 and math.isnan(values[1]) and values[2] == 2.0


def png_size(path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the signature."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", path
    assert len(data) > 1000, path  # a drawn 900x500 plot, not an empty file
    return struct.unpack(">II", data[16:24])


def test_main_writes_one_png_per_series(runs, tmp_path):
    out = tmp_path / "plots"
    written = main([*runs, "--out", str(out), "--series", ",".join(SERIES), "--labels", "a,b"])
    assert written == {name: str(out / f"{name}.png") for name in SERIES}
    assert sorted(os.listdir(out)) == sorted(f"{name}.png" for name in SERIES)  # no temporary file left
    for path in written.values():
        assert png_size(path) == (900, 500)


def test_the_command_line_with_default_labels_and_series(runs, tmp_path):
    out = tmp_path / "cli"
    result = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "plot_logs.py"), *runs, "--out", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(out)) == sorted(f"{name}.png" for name in SERIES)
    assert f"loss: {out / 'loss.png'}" in result.stdout


def test_default_series_leave_out_what_no_run_has(tmp_path, capsys):
    write_tensorboard(tmp_path / "tb", with_timers=False)
    written = main([str(tmp_path / "tb"), "--out", str(tmp_path / "out")])
    assert sorted(written) == ["grad-norm", "loss", "lr"]
    assert "note: series 'throughput'" in capsys.readouterr().err


def exit_message(argv, capsys) -> str:
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2
    return capsys.readouterr().err


def test_a_series_asked_for_that_no_run_has_is_an_error(tmp_path, capsys):
    write_tensorboard(tmp_path / "tb", with_timers=False)
    message = exit_message([str(tmp_path / "tb"), "--out", str(tmp_path / "out"), "--series", "loss,throughput"], capsys)
    assert "series 'throughput'" in message and str(tmp_path / "tb") in message
    assert not (tmp_path / "out").exists()


def test_runs_that_are_neither_a_tensorboard_directory_nor_a_log_are_errors(runs, tmp_path, capsys):
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "notes.txt").write_text("saving checkpoint at iteration 1000 to ckpt\nhello\n")
    for bad in (tmp_path / "missing.log", tmp_path / "empty_dir", tmp_path / "notes.txt"):
        message = exit_message([runs[0], str(bad), "--out", str(tmp_path / "out")], capsys)
        assert f"RUN {bad}:" in message
    assert not (tmp_path / "out").exists()


def test_bad_labels_and_series_are_errors(runs, tmp_path, capsys):
    out = ["--out", str(tmp_path / "out")]
    assert "give 2 distinct labels" in exit_message([*runs, *out, "--labels", "a"], capsys)
    assert "give 2 distinct labels" in exit_message([*runs, *out, "--labels", "a,a"], capsys)
    assert "--series speed: choose among" in exit_message([*runs, *out, "--series", "loss,speed"], capsys)
    (tmp_path / "file").write_text("")
    assert "exists and is not a directory" in exit_message([*runs, "--out", str(tmp_path / "file")], capsys)


def test_a_missing_matplotlib_is_named_with_its_install_command(runs, tmp_path, monkeypatch):
    for module in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, module, None)  # None in sys.modules makes the import fail
    with pytest.raises(SystemExit) as raised:
        main([*runs, "--out", str(tmp_path / "out")])
    assert raised.value.code == MATPLOTLIB_MISSING == "tools/plot_logs.py needs matplotlib: pip install -e '.[plot]'"
    assert not (tmp_path / "out").exists()
