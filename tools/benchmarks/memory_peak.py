"""What was allocated at a run's peak of allocated GPU memory, from PyTorch's allocator history.

    python tools/benchmarks/memory_peak.py SNAPSHOT.pickle [--top N]

A snapshot is what ``torch.cuda.memory._dump_snapshot`` writes after
``torch.cuda.memory._record_memory_history(stacks="python")``; ``tests/gpu/memory_cap`` records one for a
benchmark run with ``GPU_MEMORY_HISTORY`` set and writes this report at the rank's exit. The history's
events are replayed on one device: an ``alloc`` adds its block, ``free_requested`` (or
``free_completed`` for a block never requested free) takes it away, and the largest sum is the peak,
which matches ``torch.cuda.max_memory_allocated`` when the history covers the whole run. The blocks
alive at the peak are grouped by where they were allocated: the innermost frame in the project or in
DeepSpeed, and the code that called into that file, the largest groups first. Blocks allocated
before the history began (or dropped from its ring of ``max_entries`` events) are not seen: record
from the process's start with room for every event.
"""
import argparse
import collections
import pickle
from dataclasses import dataclass

OWN_CODE = ("/megatron/", "/deepspeed/", "pretrain_gpt.py")


@dataclass(frozen=True)
class Peak:
    """The largest allocated total over the history (bytes) and the blocks alive then, by site."""
    allocated: int
    event_index: int
    events: int
    by_site: list[tuple[str, int, int]]  # (site, bytes, blocks), largest first


def allocation_site(frames: list[dict]) -> str:
    """'file:line function' of the innermost frame in our code or DeepSpeed's, with the caller that led
    there from another file ('<- file:line function'); the innermost frame of all when none is ours."""
    if not frames:
        return "(no stack)"
    ours = [frame for frame in frames if any(part in frame["filename"] for part in OWN_CODE)]
    if not ours:
        return _named(frames[0])
    site = ours[0]
    caller = next((frame for frame in ours[1:] if frame["filename"] != site["filename"]), None)
    return _named(site) + ("" if caller is None else f" <- {_named(caller)}")


def _named(frame: dict) -> str:
    path = frame["filename"]
    for part in OWN_CODE:
        if part in path:
            path = path[path.index(part) + 1:]
            break
    return f"{path}:{frame['line']} {frame['name']}"


def peak_of(trace: list[dict]) -> Peak:
    """Replay one device's events (oldest first) and group the blocks alive at the largest total."""
    alive: dict[int, tuple[int, int]] = {}  # address -> (size, index of its alloc event)
    total = best = best_index = 0
    best_alive: dict[int, tuple[int, int]] = {}
    for index, event in enumerate(trace):
        action = event["action"]
        if action == "alloc":
            alive[event["addr"]] = (event["size"], index)
            total += event["size"]
            if total > best:
                best, best_index, best_alive = total, index, None
        elif action in ("free_requested", "free_completed") and event["addr"] in alive:
            if best_alive is None:  # the first free after a new peak: keep what was alive at it
                best_alive = dict(alive)
            total -= alive.pop(event["addr"])[0]
    if best_alive is None:
        best_alive = alive
    sizes: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for size, index in best_alive.values():
        site = allocation_site(trace[index].get("frames", []))
        sizes[site][0] += size
        sizes[site][1] += 1
    by_site = sorted(((site, size, count) for site, (size, count) in sizes.items()), key=lambda row: -row[1])
    return Peak(best, best_index, len(trace), by_site)


def report(snapshot: dict, top: int = 30) -> str:
    """The peak of each device with a history, and its largest sites, as Markdown."""
    lines = []
    for device, trace in enumerate(snapshot.get("device_traces", [])):
        if not trace:
            continue
        peak = peak_of(trace)
        lines.append(f"device {device}: peak of the recorded allocations {peak.allocated / 2**20:.0f} MiB at event "
                     f"{peak.event_index} of {peak.events}")
        lines.append("")
        lines.append("| MiB | blocks | allocated at |")
        lines.append("|---|---|---|")
        for site, size, count in peak.by_site[:top]:
            lines.append(f"| {size / 2**20:.1f} | {count} | {site} |")
        rest = peak.by_site[top:]
        if rest:
            lines.append(f"| {sum(row[1] for row in rest) / 2**20:.1f} | {sum(row[2] for row in rest)} | "
                         f"{len(rest)} other sites |")
        lines.append("")
    return "\n".join(lines) if lines else "no allocation history in the snapshot"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("snapshot", help="a pickle from torch.cuda.memory._dump_snapshot")
    parser.add_argument("--top", type=int, default=30, help="the number of sites listed (default 30)")
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error(f"--top {args.top}: list at least one site")
    try:
        with open(args.snapshot, "rb") as handle:
            snapshot = pickle.load(handle)
    except OSError as error:
        parser.error(f"{args.snapshot}: {error.strerror}")
    except (pickle.UnpicklingError, EOFError, ValueError) as error:
        parser.error(f"{args.snapshot}: not a pickled allocator snapshot ({error})")
    if not isinstance(snapshot, dict) or "device_traces" not in snapshot:
        parser.error(f"{args.snapshot}: not an allocator snapshot (no device_traces; record it with "
                     f"torch.cuda.memory._record_memory_history before torch.cuda.memory._dump_snapshot)")
    print(report(snapshot, args.top))


if __name__ == "__main__":
    main()
