"""The host memory a run holds: its processes' proportional set sizes, summed, followed over time.

    python tools/benchmarks/host_memory.py MARKER [--every SECONDS] [--output FILE]

The run is every process whose command line holds MARKER (a path only that run names: its ranks and
its launcher) and all their descendants (DataLoader workers, a fork server, compile workers), found
in /proc. A process's share is its proportional set size (Pss, /proc/PID/smaps_rollup): pages it
shares with others count a part each, so the sum is the memory the run holds once, where a sum of
resident sizes would count a worker's copy-on-write view of its parent's pages again. Where
smaps_rollup cannot be read, the resident size (VmRSS of /proc/PID/status) stands in, and the line
says so. Every SECONDS (default 2) it prints the sum in MB and the time of day (to set beside the
run's log) and, with --output, writes the largest so far there ("host peak (MB): N"); it ends when
no process of the run is left, after one was seen.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.training.signals import process_command, process_parent  # noqa: E402


def _descendants(roots: list[int], children: dict[int, list[int]]) -> set[int]:
    """``roots`` and every process below them."""
    found: set[int] = set()
    while roots:
        pid = roots.pop()
        if pid not in found:
            found.add(pid)
            roots.extend(children.get(pid, []))
    return found


def run_processes(marker: str, exclude: int | None = None) -> set[int]:
    """The processes whose command line holds ``marker`` and all their descendants, less ``exclude``
    (the caller) and its descendants."""
    pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    children: dict[int, list[int]] = {}
    for pid in pids:
        parent = process_parent(pid)
        if parent is not None:
            children.setdefault(parent, []).append(pid)
    excluded = _descendants([exclude], children) if exclude is not None else set()
    marked = [pid for pid in pids if marker in "".join(f"{argument} " for argument in process_command(pid))]
    return _descendants(marked, children) - excluded


def proportional_kib(pid: int) -> tuple[int, bool] | None:
    """(Pss in KiB, True), or (VmRSS in KiB, False) where smaps_rollup cannot be read; None once gone."""
    for path, key, proportional in ((f"/proc/{pid}/smaps_rollup", "Pss:", True),
                                    (f"/proc/{pid}/status", "VmRSS:", False)):
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith(key):
                        return int(line.split()[1]), proportional
        except OSError:
            continue
    return None


def run_memory_mb(marker: str, exclude: int | None = None) -> tuple[int, int, bool]:
    """(the run's summed share in MB, its process count, whether every share was proportional)."""
    total, count, proportional = 0, 0, True
    for pid in run_processes(marker, exclude):
        share = proportional_kib(pid)
        if share is not None:
            total, count, proportional = total + share[0], count + 1, proportional and share[1]
    return total // 1024, count, proportional


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("marker", help="a string only the run's command lines hold (e.g. its data cache path)")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between readings (default 2)")
    parser.add_argument("--output", help="a file to hold the largest reading so far")
    args = parser.parse_args(argv)
    if not args.marker.strip():
        parser.error("MARKER must not be empty: it would match every process")
    if args.every <= 0:
        parser.error(f"--every must be positive, got {args.every}")
    if not os.path.isdir("/proc"):
        parser.error("needs /proc (Linux)")
    peak, seen = 0, False
    while True:
        mb, count, proportional = run_memory_mb(args.marker, exclude=os.getpid())
        if count == 0 and seen:
            return
        seen = seen or count > 0
        if count:
            print(f"{mb} MB in {count} processes at {time.strftime('%H:%M:%S')}"
                  + ("" if proportional else " (resident sizes: no Pss here)"), flush=True)
        if mb > peak:
            peak = mb
            if args.output:
                with open(args.output, "w") as f:
                    f.write(f"host peak (MB): {peak}{'' if proportional else ' (resident sizes)'}\n")
        time.sleep(args.every)


if __name__ == "__main__":
    main()
