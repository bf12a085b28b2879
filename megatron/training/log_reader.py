"""Reads the trainer's console output back: the per-iteration line and the validation and test lines
(docs/logging.md gives their formats), whatever launcher prefix precedes them.

    log = read_log(text)
    [(r.iteration, r.number("lm loss")) for r in log.iterations]
    [(v.kind, v.set_name, v.iteration, v.loss) for v in log.validations]

The per-iteration line is `` iteration {it:8d}/{total:8d} | consumed samples: ... |`` followed by
`` {name}: {value} |`` fields; every field is kept as text, under its name, so fields added later (or
Megatron-DeepSpeed's older ``elapsed time per iteration (ms)``) are read too. Launcher prefixes such as
``[default0]:`` (torchrun), ``0: `` (srun --label) or ``worker-1: `` (pdsh) come before the line and are
skipped. Values are parsed by ``float``, so Python's ``nan``/``inf`` (``NAN``/``INF`` in E format) read
back as such.

This module imports nothing but the standard library, so log tools need neither torch nor DeepSpeed.
"""
import re
from dataclasses import dataclass, replace

ITERATION_LINE = re.compile(r" iteration\s+(?P<iteration>\d+)/\s*(?P<train_iters>\d+) \|(?= consumed samples:)")
FIELD = re.compile(r" (?P<name>[A-Za-z][A-Za-z /()%]*?):\s+(?P<value>[^|]+?) \|")
VALIDATION_LINE = re.compile(r"(?P<prefix>(?P<set_name>[\w.-]+) loss at (?P<at>.+?)) \| lm loss value: (?P<loss>\S+) \| "
                             r"lm loss PPL: (?P<ppl>\S+) \|")
DURING_TRAINING = re.compile(r"iteration (?P<iteration>\d+)$")
TEST_AT_END = "the end of training for test data"
SUMMARY_ITERATIONS = re.compile(r" training summary \| iterations: (?P<iteration>\d+) ")


@dataclass(frozen=True)
class IterationRecord:
    """One per-iteration line: the counter ``iteration``/``train_iters`` and every field as text.

    ``fields`` maps a name to its value as printed (``"lm loss": "2.345679E+00"``, ``"MFU": "13.25%"``);
    ``text`` is the line from `` iteration`` on (launcher prefix removed); ``line_number`` counts from 1.
    """

    iteration: int
    train_iters: int
    fields: dict[str, str]
    text: str
    line_number: int

    def number(self, name: str) -> float:
        """The field ``name`` as a float (a trailing ``%`` is dropped: ``MFU: 13.25%`` -> 13.25)."""
        return self._converted(name, float, "a number", self._value(name).rstrip("%"))

    def integer(self, name: str) -> int:
        """The field ``name`` as an int (counters: consumed samples, skipped iterations, ...)."""
        return self._converted(name, int, "an integer", self._value(name))

    def _converted(self, name: str, convert, kind: str, value: str):
        try:
            return convert(value)
        except ValueError:
            raise ValueError(f"line {self.line_number}: field {name!r} is not {kind} ({value!r}): "
                             f"{self.text}") from None

    def _value(self, name: str) -> str:
        if name not in self.fields:
            raise ValueError(f"line {self.line_number}: the log line has no {name!r} field: {self.text}")
        return self.fields[name]


@dataclass(frozen=True)
class ValidationRecord:
    """One evaluation line: ``{set_name} loss at {...} | lm loss value: X | lm loss PPL: Y |``.

    kind: "validation" or "test" (the test set is only evaluated at the end of training);
    set_name: "validation" for the unnamed set, else the set's name; prefix: the text before the first
    `` |`` (``validation loss at iteration 1000``); end_of_training: the final evaluation
    (``... at the end of training for val/test data``); iteration: the one in the line during training,
    at the end the iteration of the training summary that follows the line, or failing that of the
    last iteration line before it (None when there is neither).
    """

    kind: str
    set_name: str
    iteration: int | None
    loss: float
    ppl: float
    prefix: str
    end_of_training: bool
    line_number: int


@dataclass(frozen=True)
class TrainingLog:
    """Every iteration and evaluation line of a log, in the order printed."""

    iterations: list[IterationRecord]
    validations: list[ValidationRecord]


def parse_iteration_line(text: str, line_number: int = 1) -> IterationRecord | None:
    """The IterationRecord of ``text``, or None when it is no per-iteration line."""
    start = ITERATION_LINE.search(text)
    if start is None:
        return None
    fields = {match["name"]: match["value"] for match in FIELD.finditer(text, start.end())}
    return IterationRecord(int(start["iteration"]), int(start["train_iters"]), fields, text[start.start():],
                           line_number)


def parse_validation_line(text: str, line_number: int = 1) -> ValidationRecord | None:
    """The ValidationRecord of ``text`` (the end-of-training iteration left None), or None."""
    match = VALIDATION_LINE.search(text)
    if match is None:
        return None
    during = DURING_TRAINING.fullmatch(match["at"])
    try:
        loss, ppl = float(match["loss"]), float(match["ppl"])
    except ValueError:
        raise ValueError(f"line {line_number}: loss or PPL is not a number: {text.strip()}") from None
    return ValidationRecord(kind="test" if match["at"] == TEST_AT_END else "validation", set_name=match["set_name"],
                            iteration=int(during["iteration"]) if during else None, loss=loss, ppl=ppl,
                            prefix=match["prefix"], end_of_training=during is None, line_number=line_number)


def read_log(text: str) -> TrainingLog:
    """Every iteration and evaluation line of ``text``; end-of-training evaluations get their iteration
    from the training summary printed after them, or else from the last iteration line before them."""
    iterations: list[IterationRecord] = []
    validations: list[ValidationRecord] = []
    # End-of-training evaluations awaiting a summary: (index into validations, last iteration before it).
    unresolved: list[tuple[int, int | None]] = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        record = parse_iteration_line(line, line_number)
        if record is not None:
            iterations.append(record)
            continue
        evaluation = parse_validation_line(line, line_number)
        if evaluation is not None:
            if evaluation.end_of_training:
                unresolved.append((len(validations), iterations[-1].iteration if iterations else None))
            validations.append(evaluation)
            continue
        summary = SUMMARY_ITERATIONS.search(line)
        if summary is not None:
            for index, _ in unresolved:
                validations[index] = replace(validations[index], iteration=int(summary["iteration"]))
            unresolved = []
    for index, last_iteration in unresolved:
        validations[index] = replace(validations[index], iteration=last_iteration)
    return TrainingLog(iterations, validations)


def iteration_records(text: str) -> list[IterationRecord]:
    """Every per-iteration line of ``text``, in order."""
    return [record for number, line in enumerate(text.splitlines(), start=1)
            if (record := parse_iteration_line(line, number)) is not None]


def validation_records(text: str) -> list[ValidationRecord]:
    """Every validation and test line of ``text``, in order (see read_log for their iterations)."""
    return read_log(text).validations
