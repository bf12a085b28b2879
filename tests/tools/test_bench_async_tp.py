"""tools/benchmarks/bench_async_tp.py: its arguments (the timing itself runs on the GPU machine)."""
import pytest
import torch

from tools.benchmarks.bench_async_tp import parse_args


def test_bad_iterations_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--iterations", "0"])
    assert "--iterations" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_it_says_where_to_run(capsys):
    with pytest.raises(SystemExit):
        parse_args([])
    assert "GPU machine" in capsys.readouterr().err
