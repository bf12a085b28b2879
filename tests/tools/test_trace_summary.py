"""tools/benchmarks/trace_summary.py: busy, idle and exposed communication time of a kernel trace."""
import json

import pytest

from tools.benchmarks.trace_summary import kernel_class, main, subtract, summarize, union


def kernel(name, start, duration):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": duration}


def test_union_and_subtract_against_a_unit_grid():
    intervals = [(0, 3), (2, 5), (7, 8), (10, 14)]
    cover = [(1, 2), (4, 11), (13, 20)]
    grid = lambda spans: {t for s, e in spans for t in range(s, e)}  # noqa: E731
    assert union(intervals) == [(0, 5), (7, 8), (10, 14)]
    assert subtract(union(intervals), cover) == len(grid(intervals) - grid(cover)) == 5


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
