"""tools/benchmarks/trace_summary.py: busy, idle and exposed communication time of a kernel trace."""
import json

import pytest

from tools.benchmarks.trace_summary import (difference, exposed_by_waiter, idle_by_cause, kernel_class,
                                            lead_before_first_work, main, subtract, summarize, time_by_operator, union)


def kernel(name, start, duration):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": duration}


def test_union_and_subtract_against_a_unit_grid():
    intervals = [(0, 3), (2, 5), (7, 8), (10, 14)]
    cover = [(1, 2), (4, 11), (13, 20)]
    grid = lambda spans: {t for s, e in spans for t in range(s, e)}  # noqa: E731
    assert union(intervals) == [(0, 5), (7, 8), (10, 14)]
    assert subtract(union(intervals), cover) == len(grid(intervals) - grid(cover)) == 5
    assert difference(union(intervals), cover) == [(0, 1), (2, 4), (11, 13)]
    assert grid(difference(union(intervals), cover)) == grid(intervals) - grid(cover)


def test_kernel_classes():
    assert kernel_class("ncclDevKernel_AllReduce_Sum_bf16_RING_LL") == "communication"
    assert kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32") == "GEMM"
    assert kernel_class("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT") == "GEMM"
    assert kernel_class("flash_fwd_kernel") == "attention"
    assert kernel_class("vectorized_elementwise_kernel") == "other"
    assert kernel_class("c10d::symmetric_memory::barrier_kernel(unsigned int**, int, int)") == "communication"


def test_peer_copies_count_as_communication_and_other_copies_do_not():
    copy = lambda name, start, duration: {**kernel(name, start, duration), "cat": "gpu_memcpy"}  # noqa: E731
    events = [kernel("nvjet_tst_gemm", 0, 100), copy("Memcpy PtoP (Device -> Device)", 50, 80),  # 30 µs exposed
              copy("Memcpy DtoD (Device -> Device)", 200, 10)]
    figures = summarize(events)
    assert figures["communication"] == pytest.approx(0.08) and figures["exposed communication"] == pytest.approx(0.03)
    assert figures["span"] == pytest.approx(0.13)


def test_summary_of_a_step_with_overlapped_and_exposed_communication(tmp_path):
    events = [kernel("sm90_xmma_gemm", 0, 100), kernel("ncclDevKernel_AllReduce", 60, 80),  # 40 µs exposed
              kernel("flash_fwd_kernel", 150, 50), kernel("elementwise", 250, 10),
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000}]
    figures = summarize(events)
    assert figures == pytest.approx({"span": 0.26, "busy": 0.2, "idle": 0.06, "communication": 0.08,
                                     "exposed communication": 0.04, "communication kernels": 0.08,
                                     "attention kernels": 0.05, "GEMM kernels": 0.1, "other kernels": 0.01})
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    main([str(path)])


def test_a_trace_without_kernels_is_refused():
    with pytest.raises(ValueError, match="no GPU kernels"):
        summarize([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}])


@pytest.mark.parametrize("content", [None, "{not json", '{"events": []}', '{"traceEvents": []}'],
                         ids=["missing", "not json", "no traceEvents", "no kernels"])
def test_a_bad_trace_is_named(tmp_path, capsys, content):
    path = tmp_path / "trace.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        main([str(path)])
    assert exit_info.value.code == 2 and f"{path}: not a torch.profiler trace" in capsys.readouterr().err


def cpu_op(name, start, duration, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": start, "dur": duration, "tid": tid}


def launch(correlation, start, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": start, "dur": 1, "tid": tid,
            "args": {"correlation": correlation}}


def launched_kernel(name, correlation, start, duration, category="kernel"):
    return {**kernel(name, start, duration), "cat": category, "args": {"correlation": correlation}}


def operator_events():
    """A backward node around a GEMM and a copy, a bare operator, a second thread, and a kernel whose
    launch was not recorded."""
    return [
        cpu_op("iteration 6", 0, 1000),
        cpu_op("autograd::engine::evaluate_function: _ColumnParallelMatmulBackward", 10, 100),
        cpu_op("_ColumnParallelMatmulBackward", 11, 98),
        cpu_op("aten::mm", 20, 10), launch(1, 21),
        cpu_op("aten::copy_", 40, 10), launch(2, 41),
        cpu_op("aten::mm", 60, 10), launch(3, 61),
        cpu_op("aten::add_", 200, 5), launch(4, 201),
        cpu_op("MmBackward0", 300, 50, tid=2), cpu_op("aten::mm", 310, 10, tid=2), launch(5, 311, tid=2),
        launched_kernel("nvjet_gemm", 1, 500, 300), launched_kernel("Memcpy PtoP", 2, 500, 100, "gpu_memcpy"),
        launched_kernel("nvjet_gemm", 3, 800, 200), launched_kernel("elementwise", 4, 1000, 40),
        launched_kernel("nvjet_gemm", 5, 1100, 60), launched_kernel("orphan", 99, 1200, 20),
    ]


def test_time_by_operator_names_the_innermost_function_and_operator():
    assert time_by_operator(operator_events()) == pytest.approx({
        "_ColumnParallelMatmulBackward: aten::mm": 0.5, "_ColumnParallelMatmulBackward: aten::copy_": 0.1,
        "aten::add_": 0.04, "MmBackward0: aten::mm": 0.06, "(no operator)": 0.02})


def test_by_operator_table_multiplies_each_trace(tmp_path, capsys):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    one.write_text(json.dumps({"traceEvents": operator_events()}))
    two.write_text(json.dumps({"traceEvents": operator_events()[:-2]}))
    main(["--by-operator", "--multiply", "1", "2", "--minimum-ms", "0.07", str(one), str(two)])
    rows = capsys.readouterr().out.splitlines()
    assert rows[2:] == ["| _ColumnParallelMatmulBackward: aten::mm | 0.5 | 1.0 |",  # largest first
                        "| _ColumnParallelMatmulBackward: aten::copy_ | 0.1 | 0.2 |",
                        "| aten::add_ | 0.0 | 0.1 |",  # 0.08 ms doubled: above the minimum in one column
                        "| total | 0.7 | 1.3 |"]  # MmBackward0 (0.06 ms) and the orphan (0.02) only counted here


@pytest.mark.parametrize("flags, message", [
    (["--multiply", "2"], "give --by-operator too"),
    (["--minimum-ms", "2"], "--minimum-ms shapes the table of --by-operator, --idle or --exposed"),
    (["--by-operator", "--idle"], "give one"),
    (["--idle", "--exposed"], "give one"),
    (["--idle", "--multiply", "1"], "give --by-operator too"),
    (["--by-operator", "--multiply", "1", "2"], "one factor per trace: 1 traces, 2 factors"),
    (["--by-operator", "--multiply", "0"], "factors must be positive"),
    (["--by-operator", "--minimum-ms", "-1"], "--minimum-ms must be at least 0"),
])
def test_table_options_need_by_operator_and_sane_values(tmp_path, capsys, flags, message):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": operator_events()}))
    with pytest.raises(SystemExit) as exit_info:
        main(flags + ["--", str(path)])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def idle_events(scale=1):
    """Three GEMMs of one operator and a copy (times in µs x ``scale``): the second GEMM's launch
    returns 30 after the first ends (the GPU ran dry), and it starts 20 later still; the copy waits
    40 with its launch long returned; the last kernel's launch was not recorded."""
    events = [
        cpu_op("_LocalMatmul", 0, 300), cpu_op("aten::mm", 1, 4), launch(1, 2),
        cpu_op("aten::mm", 120, 15), launch(2, 129),  # returns at 130
        cpu_op("aten::copy_", 140, 5), launch(3, 141),
        cpu_op("aten::mm", 150, 5), launch(4, 151),
        launched_kernel("nvjet_gemm", 1, 0, 100),
        launched_kernel("nvjet_gemm", 2, 150, 50), launched_kernel("nvjet_gemm", 4, 160, 60),  # overlapping: no gap
        launched_kernel("Memcpy DtoD", 3, 260, 10, "gpu_memcpy"),
        launched_kernel("orphan", 99, 300, 10),
    ]
    return [{**e, "ts": e["ts"] * scale, "dur": e["dur"] * scale} for e in events]


def test_idle_is_split_into_the_hosts_part_and_waits_by_the_work_that_ends_it():
    causes = idle_by_cause(idle_events())
    assert causes == {"_LocalMatmul: aten::mm": pytest.approx((0.03, 0.02, 1)),
                      "_LocalMatmul: aten::copy_": pytest.approx((0.0, 0.04, 1)),
                      "(no operator)": pytest.approx((0.0, 0.03, 1))}
    span, busy = 310, 100 + 70 + 10 + 10
    assert sum(host + wait for host, wait, _ in causes.values()) == pytest.approx((span - busy) / 1000)


def test_idle_table(tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": idle_events(scale=100)}))
    main(["--idle", "--minimum-ms", "3.5", str(path)])
    rows = capsys.readouterr().out.splitlines()
    assert rows[0] == f"{path}: idle 12.0 ms, of which the host's 3.0 ms and waits 9.0 ms"
    assert rows[1] == "| idle ended by | host (ms) | wait (ms) | gaps |"  # no iteration range: no lead line
    assert rows[3:] == ["| _LocalMatmul: aten::mm | 3.0 | 2.0 | 1 |",  # the orphan's 3 ms gap is below 3.5
                        "| _LocalMatmul: aten::copy_ | 0.0 | 4.0 | 1 |"]


def test_the_hosts_lead_before_the_first_gpu_work():
    """An iteration range whose first kernel starts 50 µs in: the host ran a check (two nested
    operators, counted once) and a copy before launching it; a second thread's operator is not the
    iteration's."""
    events = [
        {**cpu_op("iteration 6", 0, 1000), "cat": "user_annotation"},
        cpu_op("aten::lt", 2, 20), cpu_op("aten::empty", 3, 1),
        cpu_op("aten::to", 30, 40), launch(1, 60),  # runs past the first kernel: counted up to it
        cpu_op("aten::mm", 5, 200, tid=2),
        launched_kernel("nvjet_gemm", 1, 50, 100), launched_kernel("nvjet_gemm", 2, 200, 100),
    ]
    assert lead_before_first_work(events) == ("iteration 6", pytest.approx(0.05),
                                               [("aten::lt", pytest.approx(0.02)), ("aten::to", pytest.approx(0.02))])
    assert lead_before_first_work(events[1:]) is None


def test_idle_table_names_the_hosts_lead(tmp_path, capsys):
    path = tmp_path / "trace.json"
    events = [cpu_op("iteration 3", -4000, 40000), cpu_op("aten::any", -3000, 2000)] + idle_events(scale=100)
    path.write_text(json.dumps({"traceEvents": events}))
    main(["--idle", str(path)])
    rows = capsys.readouterr().out.splitlines()
    assert rows[1] == ("before the first GPU work: 4.0 ms from the start of 'iteration 3' "
                       "(longest host operators: aten::any 2.0 ms)")


def exposed_events(scale=1):
    """An exchange beside a GEMM (times in µs x ``scale``): its barrier and peer copy outlast the GEMM by 30, then
    the dense GEMM that needs it starts; a second exchange runs alone 20 before the attention; a
    last barrier ends the trace; a copy on this device counts as neither."""
    events = [
        cpu_op("_OverlappedUlysses", 0, 500), cpu_op("aten::mm", 1, 2), launch(1, 2),
        cpu_op("aten::copy_", 3, 2), launch(2, 4), cpu_op("aten::addmm_", 5, 2), launch(3, 6),
        cpu_op("aten::_cudnn_attention_forward", 7, 2), launch(4, 8),
        launched_kernel("nvjet_gemm", 1, 0, 100), launched_kernel("barrier_kernel symmetric_memory", 10, 10, 40),
        launched_kernel("Memcpy PtoP (Device -> Device)", 2, 60, 70, "gpu_memcpy"),  # 100..130 exposed
        launched_kernel("Memcpy DtoD (Device -> Device)", 11, 130, 10, "gpu_memcpy"),
        launched_kernel("nvjet_gemm", 3, 140, 50),
        launched_kernel("Memcpy PtoP (Device -> Device)", 12, 200, 20, "gpu_memcpy"),  # 200..220 exposed
        launched_kernel("cudnn_attention_fwd", 4, 230, 100),
        launched_kernel("barrier_kernel symmetric_memory", 13, 330, 5),  # exposed, nothing after it
    ]
    return [{**e, "ts": e["ts"] * scale, "dur": e["dur"] * scale} for e in events]


def test_exposed_communication_is_charged_to_the_computation_that_waited():
    charged = exposed_by_waiter(exposed_events())
    assert charged == {"_OverlappedUlysses: aten::addmm_": pytest.approx((0.03, 1)),
                       "_OverlappedUlysses: aten::_cudnn_attention_forward": pytest.approx((0.02, 1)),
                       "(end of trace)": pytest.approx((0.005, 1))}
    assert sum(ms for ms, _ in charged.values()) == pytest.approx(summarize(exposed_events())["exposed communication"])


def test_exposed_table(tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": exposed_events(scale=100)}))
    main(["--exposed", path.as_posix()])
    rows = capsys.readouterr().out.splitlines()
    assert rows[0] == f"{path}: exposed communication 5.5 ms"
    assert rows[3:] == ["| _OverlappedUlysses: aten::addmm_ | 3.0 | 1 |",  # largest first; the end's 0.5 ms left out
                        "| _OverlappedUlysses: aten::_cudnn_attention_forward | 2.0 | 1 |"]
