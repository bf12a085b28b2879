"""bench_elementwise_ops refuses non-positive sizes, naming the flags, before it touches a GPU."""
import pytest

from tools.benchmarks import bench_elementwise_ops


def test_non_positive_sizes_are_refused(capsys):
    with pytest.raises(SystemExit) as stop:
        bench_elementwise_ops.main(["--batch", "0"])
    assert stop.value.code == 2
    assert "--seq and --batch and --repeats must be positive, got 4096 and 0 and 20" in capsys.readouterr().err
