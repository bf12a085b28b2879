"""The table of bench_before_after.sh: each figure of the earlier tree and of this one, and their ratio.

    python tools/benchmarks/compare_before_after.py BEFORE_DIR AFTER_DIR

Trainer runs (``<run>.log``): mean model TFLOP/s per GPU over the iteration lines after iteration 2.
Text generation (``text_generation.log``): our best tokens/s at each batch size.
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tools.benchmarks.scaling_table import steady_state  # noqa: E402

TRAINER_RUNS = {"peer_1p3b": "1.3B GPT, micro-batch 8", "peer_350m_mbs32": "350M GPT, micro-batch 32"}
GENERATION_LINE = re.compile(r"^batch\s+(?P<batch>\d+) \| (?P<name>ours[^|]*?)\s*\|\s*(?P<rate>[\d.]+) tokens/s")
WARMUP_ITERATIONS = 2


def trainer_figure(directory: str, run: str) -> float | None:
    try:
        with open(os.path.join(directory, f"{run}.log"), encoding="utf-8", errors="replace") as f:
            state = steady_state(run, f.read(), WARMUP_ITERATIONS)
    except OSError:
        return None
    return None if state is None else state.model_tflops_per_gpu


def generation_figures(directory: str) -> dict[int, float]:
    """batch -> our best tokens/s in ``directory``/text_generation.log."""
    best: dict[int, float] = {}
    try:
        with open(os.path.join(directory, "text_generation.log"), encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    for line in lines:
        match = GENERATION_LINE.match(line)
        if match:
            batch = int(match["batch"])
            best[batch] = max(best.get(batch, 0.0), float(match["rate"]))
    return best


def row(label: str, unit: str, before: float | None, after: float | None) -> str:
    def shown(value):
        return "n/a" if value is None else f"{value:.1f}"
    ratio = f"{after / before:.3f}" if before and after else "n/a"
    return f"| {label} | {unit} | {shown(before)} | {shown(after)} | {ratio} |"


def table(before_dir: str, after_dir: str) -> list[str]:
    lines = ["| benchmark | unit | before | after | after / before |", "|---|---|---|---|---|"]
    for run, label in TRAINER_RUNS.items():
        lines.append(row(label, "model TFLOP/s", trainer_figure(before_dir, run), trainer_figure(after_dir, run)))
    before, after = generation_figures(before_dir), generation_figures(after_dir)
    for batch in sorted(set(before) | set(after)):
        lines.append(row(f"text generation, batch {batch}", "tokens/s", before.get(batch), after.get(batch)))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    args = parser.parse_args(argv)
    print("\n".join(table(args.before, args.after)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
