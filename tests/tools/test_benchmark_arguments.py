"""The GPU benchmarks of the optimizer step, attention and GEMMs refuse non-positive sizes before they
touch a GPU (so on CPU too), naming the flags."""
import pytest

from tools.benchmarks import bench_adamw_step, bench_attention, bench_gemms


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
