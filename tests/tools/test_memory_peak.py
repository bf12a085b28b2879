"""tools/benchmarks/memory_peak.py: the peak of a replayed allocator history and what was alive at it."""
import pickle
import subprocess
import sys

from tools.benchmarks import memory_peak


def _frame(path, line, name):
    return {"filename": path, "line": line, "name": name}


ACTIVATION = [_frame("/usr/lib/torch/nn/functional.py", 10, "gelu"),
              _frame("/src/megatron/core/transformer/mlp.py", 42, "forward"),
              _frame("/src/megatron/core/transformer/mlp.py", 50, "inner"),
              _frame("/src/megatron/core/transformer/layer.py", 7, "forward")]
BUCKET = [_frame("/site/deepspeed/runtime/zero/stage3.py", 900, "reduce_ready"),
          _frame("/site/torch/autograd/graph.py", 1, "run")]


def _history():
    """Three activations (one freed before the peak), a gradient bucket that raises the peak, then frees."""
    return [
        {"action": "alloc", "addr": 1, "size": 100, "frames": ACTIVATION},
        {"action": "alloc", "addr": 2, "size": 100, "frames": ACTIVATION},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 100, "frames": ACTIVATION},
        {"action": "alloc", "addr": 4, "size": 1000, "frames": BUCKET},  # the peak: 1200
        {"action": "free_requested", "addr": 4, "size": 1000},
        {"action": "alloc", "addr": 5, "size": 900, "frames": []},  # 1100: below the peak
        {"action": "free_completed", "addr": 2, "size": 100},  # freed without a request seen
        {"action": "free_requested", "addr": 99, "size": 7},  # allocated before the history: ignored
    ]


def test_the_peak_and_the_blocks_alive_at_it_by_site():
    peak = memory_peak.peak_of(_history())
    assert (peak.allocated, peak.event_index, peak.events) == (1200, 5, 10)
    assert peak.by_site == [
        ("deepspeed/runtime/zero/stage3.py:900 reduce_ready", 1000, 1),
        ("megatron/core/transformer/mlp.py:42 forward <- megatron/core/transformer/layer.py:7 forward", 200, 2),
    ]


def test_a_stack_without_our_code_is_named_by_its_innermost_frame():
    assert memory_peak.allocation_site([_frame("/torch/a.py", 3, "f"), _frame("/torch/b.py", 4, "g")]) == \
        "/torch/a.py:3 f"
    assert memory_peak.allocation_site([]) == "(no stack)"


def test_a_history_still_rising_at_its_end_keeps_its_last_blocks():
    peak = memory_peak.peak_of(_history()[:2])
    assert (peak.allocated, [row[1:] for row in peak.by_site]) == (200, [(200, 2)])


def test_the_command_prints_each_device_with_a_history(tmp_path):
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[], _history()]}))
    printed = subprocess.run([sys.executable, "tools/benchmarks/memory_peak.py", str(path), "--top", "1"],
                             capture_output=True, text=True, check=True).stdout
    assert "device 1: peak of the recorded allocations 0 MiB at event 5 of 10" in printed
    assert "| 0.0 | 1 | deepspeed/runtime/zero/stage3.py:900 reduce_ready |" in printed
    assert "| 0.0 | 2 | 1 other sites |" in printed
    assert "device 0" not in printed


def test_the_command_names_a_file_it_cannot_read(tmp_path):
    not_pickled, no_traces = tmp_path / "notes.txt", tmp_path / "other.pickle"
    not_pickled.write_text("a text file\n")
    no_traces.write_bytes(pickle.dumps({"segments": []}))
    for path, message in ((tmp_path / "missing.pickle", "No such file or directory"),
                          (not_pickled, "not a pickled allocator snapshot"),
                          (no_traces, "not an allocator snapshot (no device_traces")):
        result = subprocess.run([sys.executable, "tools/benchmarks/memory_peak.py", str(path)],
                                capture_output=True, text=True)
        assert result.returncode == 2 and f"{path}: {message}" in result.stderr, result.stderr
    result = subprocess.run([sys.executable, "tools/benchmarks/memory_peak.py", str(no_traces), "--top", "0"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "--top 0: list at least one site" in result.stderr
