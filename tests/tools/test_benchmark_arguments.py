"""The GPU benchmarks of the optimizer step, attention and GEMMs refuse non-positive sizes (and the attention
shapes benchmark malformed shapes) before they touch a GPU (so on CPU too), naming the flags."""
import pytest

from tools.benchmarks import bench_adamw_step, bench_attention, bench_attention_shapes, bench_gemms


@pytest.mark.parametrize("main, argv, flags", [
    (bench_adamw_step.main, ["--elements", "0"], "--elements and --repeats"),
    (bench_attention.main, ["--batch", "-2"], "--batch and --repeats"),
    (bench_gemms.main, ["--repeats", "0"], "--tokens and --repeats"),
])
def test_non_positive_sizes_are_refused(main, argv, flags, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert f"{flags} must be positive" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["8x32768"], "shapes are HEADS:SEQUENCE, e.g. 8:32768"),
    (["8:0"], "shapes are two positive integers HEADS:SEQUENCE"),
    (["8:1024:2"], "shapes are two positive integers HEADS:SEQUENCE"),
])
def test_attention_shapes_are_checked_before_the_gpu(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        bench_attention_shapes.main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err
