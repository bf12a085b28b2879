"""--profile --use-pytorch-profiler: the iterations of the window, on the chosen ranks, are in the files.

IterationProfiler is driven by a loop of small matmuls here (the trace's ``iteration N`` ranges and the
table's operators are checked), the flags by parse_args, and one 2-process run profiles rank 1 only.
"""
import json

import pytest
import torch

from megatron.training.config import ProfileConfig
from megatron.training.profiling import IterationProfiler
from tests.training.pretrain_helpers import run_pretrain, tiny_run_args, training_lines
from tests.training.test_arguments import error, parse, world

CPU = torch.device("cpu")


def profile_config(directory, start=1, end=3, ranks=(0,)) -> ProfileConfig:
    return ProfileConfig(enabled=True, step_start=start, step_end=end, ranks=ranks, directory=str(directory))


def run_iterations(profiler: IterationProfiler, iterations) -> None:
    a = torch.randn(64, 64)
    for iteration in iterations:
        with profiler.iteration(iteration):
            a = torch.mm(a, a).tanh()
    profiler.close()


def recorded_iterations(trace_path) -> list[int]:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    return sorted({int(event["name"].split()[1]) for event in events
                   if event.get("name", "").startswith("iteration ")})


def test_the_window_of_iterations_is_traced_and_tabulated(tmp_path):
    run_iterations(IterationProfiler(profile_config(tmp_path), 0, CPU), range(1, 6))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["profile_rank0_iterations_2-3.pt.trace.json",
                                                                 "profile_rank0_iterations_2-3.txt"]
    assert recorded_iterations(tmp_path / "profile_rank0_iterations_2-3.pt.trace.json") == [2, 3]
    table = (tmp_path / "profile_rank0_iterations_2-3.txt").read_text()
    assert table.startswith("rank 0, iterations 2-3, sorted by self_cpu_time_total")
    assert "aten::mm" in table and "aten::tanh" in table


def test_a_run_that_ends_inside_the_window_writes_what_it_recorded(tmp_path):
    run_iterations(IterationProfiler(profile_config(tmp_path, start=2, end=10), 0, CPU), range(1, 5))
    assert recorded_iterations(tmp_path / "profile_rank0_iterations_3-4.pt.trace.json") == [3, 4]


def test_other_ranks_and_a_disabled_profiler_record_nothing(tmp_path):
    run_iterations(IterationProfiler(profile_config(tmp_path, ranks=(1,)), 0, CPU), range(1, 6))
    disabled = ProfileConfig(enabled=False, step_start=1, step_end=3, ranks=(0,), directory=str(tmp_path))
    run_iterations(IterationProfiler(disabled, 0, CPU), range(1, 6))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
def test_on_a_gpu_the_table_is_sorted_by_device_time(tmp_path):
    profiler = IterationProfiler(profile_config(tmp_path), 0, torch.device("cuda"))
    a = torch.randn(2048, 2048, device="cuda")
    for iteration in range(1, 5):
        with profiler.iteration(iteration):
            a = torch.mm(a, a).tanh()
    profiler.close()
    table = (tmp_path / "profile_rank0_iterations_2-3.txt").read_text()
    assert table.startswith("rank 0, iterations 2-3, sorted by self_device_time_total")
    assert "aten::mm" in table
    with open(tmp_path / "profile_rank0_iterations_2-3.pt.trace.json") as f:
        assert any(event.get("cat") == "kernel" for event in json.load(f)["traceEvents"])


def test_flags_reach_the_config():
    flags = parse(["--profile", "--use-pytorch-profiler", "--profile-step-start", "3", "--profile-step-end", "5",
                   "--profile-ranks", "0", "3", "--tensorboard-dir", "tb"], env=world(4)).flags
    assert (flags.profile_step_start, flags.profile_step_end, flags.profile_ranks) == (3, 5, [0, 3])


@pytest.mark.parametrize("extra, message", [
    (["--use-pytorch-profiler"], "--use-pytorch-profiler take effect only with --profile"),
    (["--profile-step-end", "4", "--profile-ranks", "1"],
     "--profile-ranks, --profile-step-end take effect only with --profile"),
    (["--profile", "--tensorboard-dir", "tb"], "add --use-pytorch-profiler"),
    (["--profile", "--use-pytorch-profiler", "--tensorboard-dir", "tb", "--profile-step-start", "5",
      "--profile-step-end", "5"], "--profile-step-start (5) must be at least 0 and below --profile-step-end (5)"),
    (["--profile", "--use-pytorch-profiler", "--tensorboard-dir", "tb", "--profile-ranks", "0", "2"],
     "--profile-ranks 2: this job has ranks 0-1"),
    (["--profile", "--use-pytorch-profiler"], "writes its trace and table into --tensorboard-dir"),
])
def test_bad_profile_flags_are_named(extra, message):
    assert message in error(extra, env=world(2))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_two_process_run_profiles_the_chosen_rank(preprocessed_corpus, tmp_path):
    tensorboard = tmp_path / "tb"
    result = run_pretrain(tiny_run_args(preprocessed_corpus, "--global-batch-size", "4", "--train-iters", "4",
                                        "--eval-iters", "0", "--tensorboard-dir", str(tensorboard), "--profile",
                                        "--use-pytorch-profiler", "--profile-step-start", "1",
                                        "--profile-step-end", "3", "--profile-ranks", "1"), nproc=2)
    assert [line["iteration"] for line in training_lines(result.stdout)] == [1, 2, 3, 4]
    trace = tensorboard / "profile_rank1_iterations_2-3.pt.trace.json"
    assert f"[rank 1] profile of iterations 2-3: {str(trace)[:-len('.pt.trace.json')]}" in result.stdout
    assert sorted(path.name for path in tensorboard.glob("profile_*")) == [
        "profile_rank1_iterations_2-3.pt.trace.json", "profile_rank1_iterations_2-3.txt"]
    assert recorded_iterations(trace) == [2, 3]
    assert "aten::mm" in (tensorboard / "profile_rank1_iterations_2-3.txt").read_text()
