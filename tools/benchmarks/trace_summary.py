"""Where a profiled iteration's GPU time goes, from a torch.profiler trace (``--profile`` output).

    python tools/benchmarks/trace_summary.py TRACE.pt.trace.json [TRACE ...]

For each trace (one device), with W the span from the first to the last kernel:
- busy: the union of all kernel intervals; idle = W - busy;
- communication: the union of NCCL kernels, symmetric-memory barriers and peer-to-peer copies
  (--tp-comm-overlap's transfers run on the copy engines, not as kernels); exposed communication =
  the part of it during which no other kernel runs (the time a faster network or more overlap
  could save);
- the kernel time by class (GEMM, attention, communication, other), summed over kernels, so that
  kernels running side by side each count.

    python tools/benchmarks/trace_summary.py --by-operator [--multiply K ...] TRACE [TRACE ...]

instead sums each trace's GPU time (kernels and copies) by what launched it: the innermost operator
around the launch, under the innermost autograd function or backward node around that
("_ColumnParallelMatmulBackward: aten::mm"), one column per trace, each multiplied by its K
(e.g. 1 2 to compare one GPU with a rank of TP=2, whose work is halved); the largest rows first.

    python tools/benchmarks/trace_summary.py --idle [--minimum-ms M] TRACE [TRACE ...]

instead splits each trace's idle time (no kernel or copy on any stream) by the kernel or copy
that ends it, named as in --by-operator: the part after the GPU ran dry until the host's launch
call of that work returned is the host's (the GPU waited for the host to issue work), the rest
a wait (the work was issued but held back: by an event of another stream, a peer). One table per
trace, largest rows first; under the profiler the host runs slower, so the host's share is an
upper bound of the unprofiled run's. Above each table, the host's lead: the time from the start of
the trainer's "iteration N" range to the iteration's first GPU work, and the host operators that
took the most of it (time the idle table cannot see, being outside the GPU's span).

    python tools/benchmarks/trace_summary.py --exposed [--minimum-ms M] TRACE [TRACE ...]

instead splits each trace's exposed communication by the computation that waited for it: each
piece is charged to the first computation kernel starting at or after its end, named as in
--by-operator (the wait of an exchange whose transfers, or whose slower peer, outlast the work
beside them).
"""
import argparse
import bisect
import collections
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


def difference(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of the disjoint, sorted ``intervals`` outside the disjoint, sorted ``cover``, in order."""
    parts, j = [], 0
    for start, end in intervals:
        position = start
        while j < len(cover) and cover[j][1] <= position:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < end:
            if cover[k][0] > position:
                parts.append((position, cover[k][0]))
            position = max(position, cover[k][1])
            k += 1
        if end > position:
            parts.append((position, end))
    return parts


def subtract(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of the disjoint ``intervals`` outside the disjoint ``cover``."""
    return length(difference(intervals, cover))


def complete_events(events: list[dict], categories: tuple[str, ...]) -> list[dict]:
    """The trace's complete events (``ph`` "X": a start and a duration) of the given ``cat``s."""
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in categories]


def timed_work(events: list[dict]) -> list[tuple[float, float, str, object]]:
    """(start, end, name, launch correlation) in µs of the kernels and peer-to-peer copies ("Memcpy PtoP
    ...": the only copies that count, as communication), sorted by start."""
    return sorted((e["ts"], e["ts"] + e["dur"], e["name"], e.get("args", {}).get("correlation"))
                  for e in complete_events(events, ("kernel", "gpu_memcpy"))
                  if e["cat"] == "kernel" or "PtoP" in e.get("name", ""))


def communication_and_computation(work: list[tuple]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The unions of the communication items of ``timed_work`` and of the others."""
    communication = union([(s, e) for s, e, name, _ in work if kernel_class(name) == "communication"])
    computation = union([(s, e) for s, e, name, _ in work if kernel_class(name) != "communication"])
    return communication, computation


def summarize(events: list[dict]) -> dict[str, float]:
    """Figures in milliseconds of the kernel events (``cat`` == "kernel", ``ts``/``dur`` in µs) and the
    peer-to-peer copies (``cat`` == "gpu_memcpy", "Memcpy PtoP ...")."""
    kernels = timed_work(events)
    if not kernels:
        raise ValueError("the trace has no GPU kernels")
    everything = union([(start, end) for start, end, _, _ in kernels])
    communication, computation = communication_and_computation(kernels)
    span = everything[-1][1] - everything[0][0]
    figures = {"span": span, "busy": length(everything), "idle": span - length(everything),
               "communication": length(communication), "exposed communication": subtract(communication, computation)}
    for label in [label for label, _ in CLASSES] + ["other"]:
        figures[f"{label} kernels"] = sum(e - s for s, e, name, _ in kernels if kernel_class(name) == label)
    return {key: value / 1000.0 for key, value in figures.items()}


GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# host ranges that name no operator: the trainer's iteration range, the autograd engine's wrappers
# around each backward node, the profiler's step ranges
_NOT_LAUNCHERS = re.compile(r"^(aten::|iteration |autograd::engine|ProfilerStep|cuda[A-Z])")


def _launch_chains(events: list[dict]) -> dict[object, list[str]]:
    """correlation id -> names of the CPU operators enclosing the runtime call with that id, outermost
    first (a sweep over each thread's operators and calls, in time order)."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") == "cpu_op":
            by_thread[e.get("tid")].append((e["ts"], 0, -e["dur"], e))
        elif e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            by_thread[e.get("tid")].append((e["ts"], 1, 0, e))
    chains = {}
    for items in by_thread.values():
        stack: list[dict] = []
        for ts, is_call, _, e in sorted(items, key=lambda item: item[:3]):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= ts:
                stack.pop()
            if is_call:
                chains[e["args"]["correlation"]] = [op["name"] for op in stack]
            else:
                stack.append(e)
    return chains


def launcher(chain: list[str]) -> str:
    """"<innermost autograd function or node>: <innermost operator>" of a launch's enclosing
    operators (outermost first); the operator alone when no function encloses it."""
    if not chain:
        return "(no operator)"
    functions = [name for name in chain if not _NOT_LAUNCHERS.match(name)]
    return f"{functions[-1]}: {chain[-1]}" if functions else chain[-1]


def time_by_operator(events: list[dict]) -> dict[str, float]:
    """GPU time in milliseconds of the trace's kernels, copies and memsets, by ``launcher``."""
    chains = _launch_chains(events)
    totals: dict[str, float] = collections.Counter()
    for e in complete_events(events, GPU_CATEGORIES):
        totals[launcher(chains.get(e.get("args", {}).get("correlation"), []))] += e["dur"] / 1000.0
    if not totals:
        raise ValueError("the trace has no GPU kernels")
    return dict(totals)


def _launch_ends(events: list[dict]) -> dict[object, float]:
    """correlation id -> time (µs) at which the host's runtime call with that id returned."""
    return {e["args"]["correlation"]: e["ts"] + e["dur"]
            for e in complete_events(events, ("cuda_runtime", "cuda_driver")) if "correlation" in e.get("args", {})}


def idle_by_cause(events: list[dict]) -> dict[str, tuple[float, float, int]]:
    """launcher -> (host ms, wait ms, gaps) of the idle gaps that its kernels and copies end.

    With the GPU's work sorted by start, a gap opens when an item starts after every earlier item
    has ended (the frontier f) and lasts until its start t. Its host part is min(t, r) - f, clipped
    at 0, with r the return of the item's launch call (the GPU had nothing to run until then);
    the rest, t - max(f, r), is a wait. An item whose launch was not recorded counts as a wait.
    """
    chains, launch_ends = _launch_chains(events), _launch_ends(events)
    work = sorted((e["ts"], e["ts"] + e["dur"], e.get("args", {}).get("correlation"))
                  for e in complete_events(events, GPU_CATEGORIES))
    if not work:
        raise ValueError("the trace has no GPU kernels")
    causes: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    frontier = work[0][1]
    for start, end, correlation in work[1:]:
        if start > frontier:
            returned = launch_ends.get(correlation, frontier)
            host = max(0.0, min(start, returned) - frontier)
            cause = causes[launcher(chains.get(correlation, []))]
            cause[0] += host / 1000.0
            cause[1] += (start - frontier - host) / 1000.0
            cause[2] += 1
        frontier = max(frontier, end)
    return {key: (host, wait, gaps) for key, (host, wait, gaps) in causes.items()}


def exposed_by_waiter(events: list[dict]) -> dict[str, tuple[float, int]]:
    """launcher -> (ms, pieces) of the exposed communication charged to the computation that waited for it.

    Each piece of communication during which no computation runs (``summarize``'s exposed
    communication) is charged to the first computation kernel that starts at or after the piece's
    end, named as in --by-operator ("(end of trace)" after the last): the work held back until the
    transfer or the peer was done.
    """
    work = timed_work(events)
    if not work:
        raise ValueError("the trace has no GPU kernels")
    chains = _launch_chains(events)
    computation_items = [(start, correlation) for start, _, name, correlation in work
                         if kernel_class(name) != "communication"]
    starts = [start for start, _ in computation_items]
    charged: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for start, end in difference(*communication_and_computation(work)):
        index = bisect.bisect_left(starts, end)
        waiter = (launcher(chains.get(computation_items[index][1], [])) if index < len(starts)
                  else "(end of trace)")
        charged[waiter][0] += (end - start) / 1000.0
        charged[waiter][1] += 1
    return {key: (ms, pieces) for key, (ms, pieces) in charged.items()}


def lead_before_first_work(events: list[dict],
                           operators: int = 3) -> tuple[str, float, list[tuple[str, float]]] | None:
    """(name of the longest "iteration N" host range, ms from its start to the first GPU work, the
    ``operators`` longest outermost host operators on its thread in that time, in ms, longest
    first); None when the trace has no such range."""
    ranges = [e for e in complete_events(events, ("cpu_op", "user_annotation"))
              if e.get("name", "").startswith("iteration ")]
    if not ranges:
        return None
    iteration = max(ranges, key=lambda e: e["dur"])
    begin = iteration["ts"]
    first_work = min(e["ts"] for e in complete_events(events, GPU_CATEGORIES))
    inside = sorted((e for e in complete_events(events, ("cpu_op",)) if e is not iteration
                     and e.get("tid") == iteration.get("tid") and begin <= e["ts"] < first_work),
                    key=lambda e: (e["ts"], -e["dur"]))
    outermost, covered_until = [], begin
    for e in inside:
        if e["ts"] >= covered_until:
            outermost.append((e["name"], (min(e["ts"] + e["dur"], first_work) - e["ts"]) / 1000.0))
            covered_until = e["ts"] + e["dur"]
    longest = sorted(outermost, key=lambda item: -item[1])[:operators]
    return iteration["name"], max(0.0, first_work - begin) / 1000.0, longest


def idle_report(events: list[dict]) -> tuple[dict[str, tuple[float, float, int]], tuple | None]:
    return idle_by_cause(events), lead_before_first_work(events)


def print_idle(path: str, report: tuple[dict[str, tuple[float, float, int]], tuple | None],
               minimum_ms: float) -> None:
    causes, lead = report
    host, wait = sum(c[0] for c in causes.values()), sum(c[1] for c in causes.values())
    print(f"{path}: idle {host + wait:.1f} ms, of which the host's {host:.1f} ms and waits {wait:.1f} ms")
    if lead is not None:
        name, lead_ms, longest = lead
        operators = ", ".join(f"{operator} {ms:.1f} ms" for operator, ms in longest) or "none"
        print(f"before the first GPU work: {lead_ms:.1f} ms from the start of '{name}' "
              f"(longest host operators: {operators})")
    print("| idle ended by | host (ms) | wait (ms) | gaps |")
    print("|---|---|---|---|")
    for key, (host, wait, gaps) in sorted(causes.items(), key=lambda item: -(item[1][0] + item[1][1])):
        if host + wait >= minimum_ms:
            print(f"| {key} | {host:.1f} | {wait:.1f} | {gaps} |")


def print_by_operator(paths: list[str], tables: list[dict[str, float]], multipliers: list[float],
                      minimum_ms: float) -> None:
    scaled = [{key: value * k for key, value in table.items()} for table, k in zip(tables, multipliers)]
    keys = sorted({key for table in scaled for key in table}, key=lambda key: -max(t.get(key, 0.0) for t in scaled))
    print("| launched by | " + " | ".join(f"{path} x{k:g} (ms)" for path, k in zip(paths, multipliers)) + " |")
    print("|---" * (len(paths) + 1) + "|")
    for key in keys:
        if max(t.get(key, 0.0) for t in scaled) >= minimum_ms:
            print(f"| {key} | " + " | ".join(f"{t.get(key, 0.0):.1f}" for t in scaled) + " |")
    print("| total | " + " | ".join(f"{sum(t.values()):.1f}" for t in scaled) + " |")


def print_exposed(path: str, charged: dict[str, tuple[float, int]], minimum_ms: float) -> None:
    print(f"{path}: exposed communication {sum(ms for ms, _ in charged.values()):.1f} ms")
    print("| waited for it | exposed (ms) | pieces |")
    print("|---|---|---|")
    for key, (ms, pieces) in sorted(charged.items(), key=lambda item: -item[1][0]):
        if ms >= minimum_ms:
            print(f"| {key} | {ms:.1f} | {pieces} |")


def _check_table_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.by_operator + args.idle + args.exposed > 1:
        parser.error("--by-operator, --idle and --exposed print different tables: give one")
    if args.multiply is not None and not args.by_operator:
        parser.error("--multiply shapes the table of --by-operator: give --by-operator too")
    if args.minimum_ms is not None and not (args.by_operator or args.idle or args.exposed):
        parser.error("--minimum-ms shapes the table of --by-operator, --idle or --exposed: give one of them too")
    if args.multiply is not None:
        if len(args.multiply) != len(args.traces):
            parser.error(f"--multiply takes one factor per trace: {len(args.traces)} traces, "
                         f"{len(args.multiply)} factors")
        if min(args.multiply) <= 0:
            parser.error(f"--multiply factors must be positive, got {args.multiply}")
    if args.minimum_ms is not None and args.minimum_ms < 0:
        parser.error(f"--minimum-ms must be at least 0, got {args.minimum_ms}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--by-operator", action="store_true", help="GPU time by the operator that launched it")
    parser.add_argument("--multiply", type=float, nargs="+", metavar="K",
                        help="with --by-operator: one factor per trace (default 1 each)")
    parser.add_argument("--idle", action="store_true", help="the idle time by the work that ends it, host or wait")
    parser.add_argument("--exposed", action="store_true",
                        help="the exposed communication by the computation that waited for it")
    parser.add_argument("--minimum-ms", type=float, default=None,
                        help="with --by-operator, --idle or --exposed: leave out rows below this (in every column; "
                             "default 1)")
    args = parser.parse_args(argv)
    _check_table_options(parser, args)
    multipliers = args.multiply or [1.0] * len(args.traces)
    summary = (time_by_operator if args.by_operator else idle_report if args.idle
               else exposed_by_waiter if args.exposed else summarize)
    rows = []
    for path in args.traces:
        try:
            with open(path) as f:
                rows.append((path, summary(json.load(f)["traceEvents"])))
        except (OSError, ValueError, KeyError, TypeError) as error:
            parser.error(f"{path}: not a torch.profiler trace with GPU kernels ({type(error).__name__}: {error})")
    minimum_ms = 1.0 if args.minimum_ms is None else args.minimum_ms
    if args.by_operator:
        print_by_operator(args.traces, [table for _, table in rows], multipliers, minimum_ms)
        return
    if args.idle or args.exposed:
        for path, report in rows:
            (print_idle if args.idle else print_exposed)(path, report, minimum_ms)
        return
    keys = list(rows[0][1])
    print("| trace | " + " | ".join(f"{key} (ms)" for key in keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for path, figures in rows:
        print(f"| {path} | " + " | ".join(f"{figures[key]:.1f}" for key in keys) + " |")


if __name__ == "__main__":
    main()
