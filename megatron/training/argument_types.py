"""Value types of the command line: the error class, number notations, booleans, rejected flags.

Numbers are read in the notations of the BigScience launch scripts:

    integer flags   "6_000_000", "10e6", "2e9", "1024"     (a float literal is accepted when its
                                                            value is a whole number: 10e6 -> 10000000)
    float flags     "6e-5", "0.95", "1_000.5"

"1.5" for an integer flag is an error that names the flag. Booleans of Megatron-DeepSpeed's
``type=bool`` flags (--eval-only, --onnx-safe, --lazy-mpu-init) are read as true/false, 1/0, yes/no,
on/off, instead of argparse's "any non-empty string is True" there.
"""
import argparse
import math

TRUE_WORDS = ("true", "1", "yes", "on")
FALSE_WORDS = ("false", "0", "no", "off")


class ArgumentError(ValueError):
    """A command line that cannot work; the message names the flag(s) and the fix."""


def parse_int(text: str) -> int:
    """Integer in the BigScience scripts' notations: "6_000_000", "10e6" (a whole-valued float), "-1"."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not math.isfinite(value) or not value.is_integer():
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r} (not a whole number)")
    return int(value)


def parse_float(text: str) -> float:
    """Finite float: "6e-5", "0.95", "1_000.5"."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def parse_bool(text: str) -> bool:
    """true/false, 1/0, yes/no, on/off (any case)."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(
        f"expected a boolean ({'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)}), got {text!r}")


def parse_iteration_ranges(values, flag: str) -> tuple[tuple[int, int], ...]:
    """``["10-20", "15-30", "40-40"]`` -> ((10, 30), (40, 40)): inclusive ranges of iteration numbers
    (1-based), sorted and merged where they overlap or touch. ArgumentError names ``flag``."""
    ranges = []
    for text in values:
        start, dash, end = text.partition("-")
        if not dash or not start.strip().isdigit() or not end.strip().isdigit():
            raise ArgumentError(f"{flag}: {text!r} is not a range START-END of iteration numbers, e.g. 1000-1200")
        first, last = int(start), int(end)
        if not 1 <= first <= last:
            raise ArgumentError(f"{flag}: {text!r} must have 1 <= START <= END")
        ranges.append((first, last))
    merged = []
    for first, last in sorted(ranges):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return tuple(merged)


def parse_interval_ranges(values, flag: str) -> tuple[tuple[int, int, int], ...]:
    """``["1-100:10", "101-1000:50"]`` -> ((1, 100, 10), (101, 1000, 50)): inclusive iteration ranges,
    each with its interval, sorted; overlapping ranges are refused. ArgumentError names ``flag``."""
    found = []
    for text in values:
        span, colon, interval = text.partition(":")
        if not colon or not interval.strip().isdigit() or int(interval) < 1:
            raise ArgumentError(f"{flag}: {text!r} is not START-END:INTERVAL (e.g. 1-100:10)")
        ((start, end),) = parse_iteration_ranges([span], flag)
        found.append((start, end, int(interval)))
    found.sort()
    for (_, end, _), (start, _, _) in zip(found, found[1:]):
        if start <= end:
            raise ArgumentError(f"{flag}: the ranges overlap at iteration {start}; give each iteration one interval")
    return tuple(found)


class RejectedFlag(argparse.Action):
    """A flag that is recognised but refused: parsing it raises ArgumentError with ``reason``.

    It swallows any values that follow (``nargs="*"``), so ``--skip-train-iteration-range 10-20``
    gets the flag's own message rather than an "unrecognized arguments" error.
    """

    def __init__(self, option_strings, dest, reason, **kwargs):
        kwargs.setdefault("nargs", "*")
        kwargs.setdefault("help", argparse.SUPPRESS)
        kwargs.setdefault("default", argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None):
        raise ArgumentError(f"{option_string}: {self.reason}")


class ErrorRaisingParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise ArgumentError instead of printing usage and exiting."""

    def error(self, message):
        raise ArgumentError(message)
