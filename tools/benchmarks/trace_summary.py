"""Where a profiled iteration's GPU time goes, from a torch.profiler trace (``--profile`` output).

    python tools/benchmarks/trace_summary.py TRACE.pt.trace.json [TRACE ...]

For each trace (one device), with W the span from the first to the last kernel:
- busy: the union of all kernel intervals; idle = W - busy;
- communication: the union of NCCL kernels, symmetric-memory barriers and peer-to-peer copies
  (--tp-comm-overlap's transfers run on the copy engines, not as kernels); exposed communication = the part of it during which no
  other kernel runs (the time a faster network or more overlap could save);
- the kernel time by class (GEMM, attention, communication, other), summed over kernels, so that
  kernels running side by side each count.
"""
import argparse
import json
import re

CLASSES = (  # first match wins
    ("communication", re.compile(r"nccl|symmetric_memory|PtoP", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn", re.I)),
    ("GEMM", re.compile(r"gemm|xmma|cutlass|nvjet|cublas|matmul", re.I)),
)


def kernel_class(name: str) -> str:
    for label, pattern in CLASSES:
        if pattern.search(name):
            return label
    return "other"


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge [start, end) intervals into disjoint ones, sorted."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def subtract(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of the disjoint ``intervals`` outside the disjoint ``cover``."""
    outside, j = 0.0, 0
    for start, end in intervals:
        position = start
        while j < len(cover) and cover[j][1] <= position:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < end:
            outside += max(0.0, cover[k][0] - position)
            position = max(position, cover[k][1])
            k += 1
        outside += max(0.0, end - position)
    return outside


def summarize(events: list[dict]) -> dict[str, float]:
    """Figures in milliseconds of the kernel events (``cat`` == "kernel", ``ts``/``dur`` in µs) and the
    peer-to-peer copies (``cat`` == "gpu_memcpy", "Memcpy PtoP ...")."""
    kernels = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("ph") == "X" and (
        e.get("cat") == "kernel" or (e.get("cat") == "gpu_memcpy" and "PtoP" in e.get("name", "")))]
    if not kernels:
        raise ValueError("the trace has no GPU kernels")
    everything = union([(start, end) for start, end, _ in kernels])
    communication = union([(s, e) for s, e, name in kernels if kernel_class(name) == "communication"])
    computation = union([(s, e) for s, e, name in kernels if kernel_class(name) != "communication"])
    span = everything[-1][1] - everything[0][0]
    figures = {"span": span, "busy": length(everything), "idle": span - length(everything),
               "communication": length(communication), "exposed communication": subtract(communication, computation)}
    for label in [label for label, _ in CLASSES] + ["other"]:
        figures[f"{label} kernels"] = sum(e - s for s, e, name in kernels if kernel_class(name) == label)
    return {key: value / 1000.0 for key, value in figures.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    args = parser.parse_args(argv)
    rows = []
    for path in args.traces:
        try:
            with open(path) as f:
                rows.append((path, summarize(json.load(f)["traceEvents"])))
        except (OSError, ValueError, KeyError, TypeError) as error:
            parser.error(f"{path}: not a torch.profiler trace with GPU kernels ({type(error).__name__}: {error})")
    keys = list(rows[0][1])
    print("| trace | " + " | ".join(f"{key} (ms)" for key in keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for path, figures in rows:
        print(f"| {path} | " + " | ".join(f"{figures[key]:.1f}" for key in keys) + " |")


if __name__ == "__main__":
    main()
