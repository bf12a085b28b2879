"""tools/benchmarks/bench_collectives.py on two gloo processes: checked results and a row per collective and size."""
import pytest
import torch

from tests.dist_utils import run_distributed
from tools.benchmarks.bench_collectives import OPERATIONS, bus_factor, parse_args, table


def _worker(rank, world_size):
    lines = table([0.25, 0.5], list(OPERATIONS), iterations=2, device=torch.device("cpu"))
    assert lines[0] == "| collective | MB | ranks | ms | algorithm GB/s | bus GB/s |"
    rows = [line.strip("|").split("|") for line in lines[2:]]
    assert [(row[0].strip(), row[1].strip(), row[2].strip()) for row in rows] == \
        [(operation, size, "2") for operation in OPERATIONS for size in ("0.25", "0.5")]
    for operation, *_, milliseconds, algorithm, bus in rows:
        assert float(milliseconds) > 0
        assert abs(float(bus) - float(algorithm) * bus_factor(operation.strip(), 2)) < 0.1


def test_rows_of_checked_collectives():
    run_distributed(_worker, 2)


def test_bus_bandwidth_factors_are_nccls():
    assert bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == 0.75


@pytest.mark.parametrize("argv, flag", [(["--iterations", "0"], "--iterations"), (["--sizes-mb", "0"], "--sizes-mb"),
                                        (["--operations", "broadcast"], "--operations")])
def test_bad_arguments_name_the_flag(capsys, argv, flag):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert flag in capsys.readouterr().err
