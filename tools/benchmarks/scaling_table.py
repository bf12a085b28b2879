"""The scaling table of trainer logs: per-GPU model TFLOP/s of each layout against the first (one GPU).

    python3 tools/benchmarks/scaling_table.py --skip 3 1gpu=A.log dp2=B.log "pp2:8=C.log" ...

Each argument is NAME=LOG, the first the single-GPU reference. A name ``pp<p>:<m>`` (p stages,
m micro-batches per step) also prints the pipeline's bound 1 - (p - 1) / (m + p - 1): the share of
the step that 1F1B keeps busy when the stages are balanced. Steady state: the iterations after the
first ``--skip`` (warm-up, allocator growth, autotuning), read with log interval 1; each column is
the mean over them. Exit status 1 when a log has no steady-state iteration.
"""
import argparse
import os
import re
import sys
from dataclasses import dataclass
from statistics import mean

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.training.log_reader import iteration_records  # noqa: E402

PIPELINE_NAME = re.compile(r"pp(?P<stages>\d+):(?P<micro_batches>\d+)")


@dataclass(frozen=True)
class SteadyState:
    name: str
    iterations: int
    seconds_per_iteration: float
    model_tflops_per_gpu: float


def steady_state(name: str, text: str, skip: int) -> SteadyState | None:
    """Means over the iteration lines after ``skip`` of the iteration time and per-GPU model TFLOP/s."""
    records = [record for record in iteration_records(text) if record.iteration > skip]
    if not records:
        return None
    return SteadyState(name, len(records), mean(r.number("elapsed time per iteration (s)") for r in records),
                       mean(r.number("model TFLOP/s") for r in records))


def pipeline_bound(name: str) -> float | None:
    """1 - (p - 1) / (m + p - 1) for a name ``...pp<p>:<m>...``, else None."""
    match = PIPELINE_NAME.search(name)
    if match is None:
        return None
    stages, micro_batches = int(match["stages"]), int(match["micro_batches"])
    return 1.0 - (stages - 1) / (micro_batches + stages - 1)


def table(states: list[SteadyState]) -> list[str]:
    """Markdown rows: run, steady iterations, s/iteration, per-GPU model TFLOP/s, ratio to the first, bound."""
    reference = states[0].model_tflops_per_gpu
    lines = ["| run | steady iterations | s/iteration | per-GPU model TFLOP/s | vs 1 GPU | pipeline bound |",
             "|---|---|---|---|---|---|"]
    for state in states:
        bound = pipeline_bound(state.name)
        lines.append(f"| {state.name} | {state.iterations} | {state.seconds_per_iteration:.3f} | "
                     f"{state.model_tflops_per_gpu:.1f} | {state.model_tflops_per_gpu / reference:.1%} | "
                     f"{'' if bound is None else f'{bound:.1%}'} |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip", type=int, default=3, help="warm-up iterations left out")
    parser.add_argument("runs", nargs="+", help="NAME=LOG, the single-GPU run first")
    args = parser.parse_args(argv)
    states = []
    for run in args.runs:
        name, separator, path = run.partition("=")
        if not separator:
            parser.error(f"{run!r}: expected NAME=LOG")
        with open(path, encoding="utf-8", errors="replace") as log:
            state = steady_state(name, log.read(), args.skip)
        if state is None:
            print(f"{path}: no iteration line after iteration {args.skip}", file=sys.stderr)
            return 1
        states.append(state)
    print("\n".join(table(states)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
