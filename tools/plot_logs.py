"""Plot the training curves of one or more runs, one PNG per series, every run on the same axes.

    python tools/plot_logs.py RUN [RUN ...] --out DIR [--series loss,lr,grad-norm,throughput] [--labels a,b]

A RUN is a TensorBoard directory (the trainer's --tensorboard-dir: event files read with
TensorBoard's EventAccumulator; a resumed run's several files are read as one) or a log file (the
trainer's console output, read by megatron.training.log_reader). The x-axis is the iteration. Series:

    name        log field              TensorBoard tag
    loss        lm loss                lm-loss-training/lm loss      + validation loss points
    lr          learning rate          learning-rate/learning-rate
    grad-norm   grad norm              grad-norm/grad-norm
    throughput  samples per second     iteration-time/samples per second (--log-timers-to-tensorboard)

The log's loss is the mean of the log interval, TensorBoard's that of the iteration. Validation points
come from the `` loss at iteration N`` lines or the ``lm-loss-validation/[NAME/]lm loss validation``
tags, one marker per validation set; the end-of-training evaluation sits at the iteration where
training stopped. An iteration logged twice (a run resumed from an earlier checkpoint into the same
log or directory) keeps its last value.

Errors (exit status 2): a RUN that is neither a directory with event files nor a readable log file
with iteration lines; a series asked for with --series that no run has (without --series, such a
series is left out with a note). Each PNG is written to a temporary name and renamed. matplotlib is
an optional dependency (pip install -e .[plot]).
"""
import argparse
import glob
import itertools
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.log_reader import read_log  # noqa: E402

MATPLOTLIB_MISSING = "tools/plot_logs.py needs matplotlib: pip install -e '.[plot]'"
EVENT_FILES = "events.out.tfevents.*"
VALIDATION_TAG = re.compile(r"lm-loss-validation/(?:(?P<set_name>.+)/)?lm loss validation")
UNNAMED_VALIDATION_SET = "validation"
VALIDATION_MARKERS = "osD^v*"

Points = tuple[list[int], list[float]]  # (iterations, values), iterations ascending


@dataclass(frozen=True)
class SeriesSource:
    """Where a series is read: the field of the log line, the TensorBoard tag, and the y-axis label."""

    log_field: str
    tag: str
    axis_label: str


SERIES = {
    "loss": SeriesSource("lm loss", "lm-loss-training/lm loss", "lm loss"),
    "lr": SeriesSource("learning rate", "learning-rate/learning-rate", "learning rate"),
    "grad-norm": SeriesSource("grad norm", "grad-norm/grad-norm", "gradient norm (before clipping)"),
    "throughput": SeriesSource("samples per second", "iteration-time/samples per second", "samples per second"),
}


class PlotError(ValueError):
    """A RUN or a series that cannot be plotted; the message names it."""


@dataclass(frozen=True)
class Run:
    """One run's curves: ``series`` by series name, ``validation`` by validation set name."""

    label: str
    path: str
    series: dict[str, Points]
    validation: dict[str, Points]


def points(pairs: list[tuple[int, float]]) -> Points:
    """(iterations, values) in ascending iteration; of an iteration given twice, the later value."""
    by_iteration = dict(pairs)
    iterations = sorted(by_iteration)
    return iterations, [by_iteration[i] for i in iterations]


def load_log_run(path: str, label: str) -> Run:
    """A run from the trainer's console output in the file ``path``."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            log = read_log(handle.read())
    except (OSError, ValueError) as error:
        raise PlotError(f"RUN {path}: cannot read the log file: {error}") from None
    if not log.iterations:
        raise PlotError(f"RUN {path}: no iteration line (' iteration N/ M | consumed samples: ...') in the file; "
                        f"give a log file of pretrain_gpt.py or a TensorBoard directory")
    series = {}
    for name, source in SERIES.items():
        try:
            pairs = [(r.iteration, r.number(source.log_field)) for r in log.iterations if source.log_field in r.fields]
        except ValueError as error:
            raise PlotError(f"RUN {path}: {error}") from None
        if pairs:
            series[name] = points(pairs)
    validation_pairs: dict[str, list[tuple[int, float]]] = {}
    for record in log.validations:
        if record.kind == "validation" and record.iteration is not None:
            validation_pairs.setdefault(record.set_name, []).append((record.iteration, record.loss))
    return Run(label, path, series, {name: points(pairs) for name, pairs in validation_pairs.items()})


def load_tensorboard_run(path: str, label: str) -> Run:
    """A run from the TensorBoard event files directly in the directory ``path``."""
    if not glob.glob(os.path.join(glob.escape(path), EVENT_FILES)):
        raise PlotError(f"RUN {path}: a directory without TensorBoard event files ({EVENT_FILES}); "
                        f"give the run's --tensorboard-dir or its log file")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(path, size_guidance={"scalars": 0})  # 0: keep every value
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])

    def read(tag: str) -> Points:
        return points([(event.step, event.value) for event in accumulator.Scalars(tag)])

    series = {name: read(source.tag) for name, source in SERIES.items() if source.tag in tags}
    validation = {}
    for tag in sorted(tags):
        match = VALIDATION_TAG.fullmatch(tag)
        if match is not None:
            validation[match["set_name"] or UNNAMED_VALIDATION_SET] = read(tag)
    return Run(label, path, series, validation)


def load_run(path: str, label: str) -> Run:
    """The run in ``path``: a TensorBoard directory or a log file."""
    if os.path.isdir(path):
        return load_tensorboard_run(path, label)
    if os.path.isfile(path):
        return load_log_run(path, label)
    raise PlotError(f"RUN {path}: no such file or directory; give a TensorBoard directory or a log file")


def series_points(runs: Sequence[Run], name: str) -> dict[str, Points]:
    """{run label: (iterations, values)} of the series ``name`` in the runs that have it: what is drawn."""
    return {run.label: run.series[name] for run in runs if name in run.series}


def validation_points(runs: Sequence[Run]) -> dict[str, dict[str, Points]]:
    """{run label: {validation set: (iterations, losses)}}: the points drawn on the loss plot."""
    return {run.label: run.validation for run in runs if run.validation}


def available_series(runs: Sequence[Run], names: Sequence[str], required: bool) -> list[str]:
    """The series of ``names`` that some run has. One that no run has is an error when ``required``
    (asked for with --series), else left out with a note on stderr."""
    found = []
    for name in names:
        if series_points(runs, name):
            found.append(name)
            continue
        source = SERIES[name]
        message = (f"series {name!r} (log field {source.log_field!r}, TensorBoard tag {source.tag!r}) "
                   f"is in none of the runs: {', '.join(run.path for run in runs)}")
        if required:
            raise PlotError(message)
        print(f"note: {message}; left out", file=sys.stderr)
    if not found:
        raise PlotError(f"none of the series {', '.join(names)} is in the runs: {', '.join(r.path for r in runs)}")
    return found


def agg_figure():
    """A matplotlib Figure drawn by the Agg backend (no display, no pyplot state)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        sys.exit(MATPLOTLIB_MISSING)
    figure = Figure(figsize=(9, 5), dpi=100)
    FigureCanvasAgg(figure)
    return figure


def finite_or_gap(values: list[float]) -> list[float]:
    """inf (an fp16 overflow's loss) would stretch the axis to nothing; nan leaves a gap instead."""
    return [value if math.isfinite(value) else math.nan for value in values]


def draw_series(runs: Sequence[Run], name: str):
    """The figure of the series ``name``: one line per run; on the loss plot, each run's validation
    losses as markers of the run's colour (one marker shape per validation set)."""
    figure = agg_figure()
    axes = figure.add_subplot()
    for run in runs:
        if name not in run.series:
            continue
        iterations, values = run.series[name]
        line, = axes.plot(iterations, finite_or_gap(values), label=run.label, linewidth=1.2)
        if name != "loss":
            continue
        for marker, (set_name, (steps, losses)) in zip(itertools.cycle(VALIDATION_MARKERS), sorted(run.validation.items())):
            axes.plot(steps, finite_or_gap(losses), linestyle="none", marker=marker, color=line.get_color(),
                      markeredgecolor="black", label=f"{run.label} {set_name} loss")
    axes.set_xlabel("iteration")
    axes.set_ylabel(SERIES[name].axis_label)
    axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))  # 1e-4 rather than 0.00010
    axes.set_title(name)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    return figure


def write_png(figure, path: str) -> None:
    """Save ``figure`` as PNG under a temporary name beside ``path``, then rename it to ``path``."""
    temporary = f"{path}.tmp.{os.getpid()}"
    try:
        with open(temporary, "wb") as handle:
            figure.savefig(handle, format="png")
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def default_labels(paths: Sequence[str]) -> list[str]:
    """Each RUN's base name (a log file's without extension); the paths as given if two coincide."""
    names = [os.path.basename(os.path.normpath(path)) for path in paths]
    labels = [name if os.path.isdir(path) else os.path.splitext(name)[0] for name, path in zip(names, paths)]
    return labels if len(set(labels)) == len(labels) else list(paths)


def parse_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN", help="a TensorBoard directory or a log file")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory of the PNGs (made if missing)")
    parser.add_argument("--series", type=parse_list, default=None,
                        help=f"comma-separated, of {','.join(SERIES)} (default: all that some run has)")
    parser.add_argument("--labels", type=parse_list, default=None,
                        help="comma-separated legend labels, one per RUN (default: the RUNs' base names)")
    return parser


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The labels of the runs, after checking --series and --labels."""
    unknown = [name for name in args.series or [] if name not in SERIES]
    if unknown or args.series == []:
        parser.error(f"--series {','.join(unknown) or '(empty)'}: choose among {','.join(SERIES)}")
    labels = default_labels(args.runs) if args.labels is None else args.labels
    if len(labels) != len(args.runs) or len(set(labels)) != len(labels):
        parser.error(f"--labels {','.join(labels)}: give {len(args.runs)} distinct labels, one per RUN")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out}: exists and is not a directory")
    return labels


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
    """Write the PNGs; returns {series: path}. Bad input exits with status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    labels = check_arguments(parser, args)
    agg_figure()  # fail on a missing matplotlib before reading any run
    requested = list(dict.fromkeys(args.series)) if args.series else list(SERIES)
    try:
        runs = [load_run(path, label) for path, label in zip(args.runs, labels)]
        names = available_series(runs, requested, required=args.series is not None)
    except PlotError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    os.makedirs(args.out, exist_ok=True)
    written = {}
    for name in names:
        written[name] = os.path.join(args.out, f"{name}.png")
        write_png(draw_series(runs, name), written[name])
        print(f"{name}: {written[name]}")
    return written


if __name__ == "__main__":
    main()
