"""Parsing of the data-selection flags into typed values.

Option 1, ``--data-path`` and ``--split``:
    ``--data-path PREFIX`` or ``--data-path W1 PREFIX1 W2 PREFIX2 ...`` (a weighted blend), and
    ``--split "969, 30, 1"`` (or ``"969/30/1"``): train/valid/test proportions of each dataset's
    documents, turned into document boundaries exactly as Megatron does.

Option 2, named groups:
    ``--train-weighted-split-paths "NAME: W1 S1:E1 PATH1, W2 S2:E2 PATH2"`` (exactly one group),
    ``--valid-weighted-split-paths`` / ``--test-weighted-split-paths`` (one or more groups, each a
    separately named dataset). ``S:E`` are document fractions in [0, 1] with S < E. The ``-path``
    variants name a file holding the groups as double-quoted strings: ``"GROUP1" "GROUP2"``.

Errors raise DataPathError naming the flag (or file) and the offending token.
"""
import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_SPLIT = "969, 30, 1"


class DataPathError(ValueError):
    """A data flag's value cannot be parsed; the message names the flag and the bad token."""


@dataclass(frozen=True)
class WeightedPrefix:
    """One dataset of an Option-1 blend: its weight (not normalised) and .bin/.idx prefix."""

    weight: float
    prefix: str


@dataclass(frozen=True)
class GroupEntry:
    """One dataset of an Option-2 group: weight, document range [start, end) as fractions, prefix."""

    weight: float
    start: float
    end: float
    prefix: str


@dataclass(frozen=True)
class DatasetGroup:
    """An Option-2 named group: its datasets are blended by weight under the group's name."""

    name: str
    entries: tuple[GroupEntry, ...]


def _parse_weight(token, flag):
    try:
        weight = float(token)
    except ValueError:
        raise DataPathError(f"{flag}: expected a weight, got {token!r}") from None
    if not math.isfinite(weight) or weight <= 0:
        raise DataPathError(f"{flag}: weight {token!r} must be a positive finite number")
    return weight


def parse_data_path(values: Sequence[str], flag: str = "--data-path") -> tuple[WeightedPrefix, ...]:
    """``[PREFIX]`` -> one prefix of weight 1; ``[W1, P1, W2, P2, ...]`` -> weighted prefixes."""
    values = list(values)
    if not values:
        raise DataPathError(f"{flag}: expected a prefix or weight/prefix pairs, got nothing")
    if len(values) == 1:
        return (WeightedPrefix(1.0, values[0]),)
    if len(values) % 2 != 0:
        raise DataPathError(
            f"{flag}: expected weight/prefix pairs 'W1 P1 W2 P2 ...', got {len(values)} values "
            f"(the last, {values[-1]!r}, has no partner)")
    return tuple(WeightedPrefix(_parse_weight(w, flag), p) for w, p in zip(values[::2], values[1::2]))


def parse_split(text: str = DEFAULT_SPLIT, flag: str = "--split") -> tuple[float, float, float]:
    """``"a, b, c"`` or ``"a/b/c"`` -> (a, b, c) / (a + b + c); missing entries are 0."""
    separator = "/" if "/" in text else ","
    tokens = [t.strip() for t in text.split(separator)]
    if len(tokens) > 3:
        raise DataPathError(f"{flag}: expected at most 3 proportions (train, valid, test), got {text!r}")
    proportions = []
    for token in tokens:
        try:
            value = float(token)
        except ValueError:
            raise DataPathError(f"{flag}: {token!r} in {text!r} is not a number") from None
        if not math.isfinite(value) or value < 0:
            raise DataPathError(f"{flag}: proportion {token!r} in {text!r} must be >= 0")
        proportions.append(value)
    proportions += [0.0] * (3 - len(proportions))
    total = sum(proportions)
    if total <= 0:
        raise DataPathError(f"{flag}: the proportions in {text!r} sum to zero")
    return tuple(p / total for p in proportions)


def split_document_boundaries(split: Sequence[float], num_documents: int) -> list[int]:
    """Boundaries [0, b1, b2, num_documents] of the train/valid/test documents, as Megatron.

    b_i accumulates round(fraction_i * num_documents); any rounding excess is taken off every
    boundary after the first so the last equals num_documents (kept for identical splits).
    """
    boundaries = [0]
    for fraction in split:
        boundaries.append(boundaries[-1] + int(round(fraction * float(num_documents))))
    excess = boundaries[-1] - num_documents
    return [boundaries[0]] + [b - excess for b in boundaries[1:]]


def range_document_boundaries(start: float, end: float, num_documents: int) -> tuple[int, int]:
    """Document range [round(start * n), round(end * n)) of an Option-2 entry."""
    return round(start * float(num_documents)), round(end * float(num_documents))


def _parse_range(token, flag):
    parts = token.split(":")
    if len(parts) != 2:
        raise DataPathError(f"{flag}: expected a document range START:END, got {token!r}")
    try:
        start, end = float(parts[0]), float(parts[1])
    except ValueError:
        raise DataPathError(f"{flag}: range {token!r} must be two numbers START:END") from None
    if not (0.0 <= start < end <= 1.0):
        raise DataPathError(f"{flag}: range {token!r} must satisfy 0 <= START < END <= 1")
    return start, end


def parse_weighted_split_group(text: str, flag: str) -> DatasetGroup:
    """``"NAME: W1 S1:E1 PATH1, W2 S2:E2 PATH2"`` -> DatasetGroup."""
    name, colon, body = text.partition(":")
    name = name.strip()
    if not colon or not name or any(c.isspace() for c in name):
        raise DataPathError(
            f"{flag}: group {text!r} must start with 'NAME:' (a name without spaces), as in "
            f"'NAME: W1 S1:E1 PATH1, W2 S2:E2 PATH2'")
    entries = []
    for item in body.split(","):
        fields = item.split()
        if len(fields) != 3:
            raise DataPathError(
                f"{flag}: group {name!r}: expected 'WEIGHT START:END PATH', got {item.strip()!r}")
        start, end = _parse_range(fields[1], flag)
        entries.append(GroupEntry(_parse_weight(fields[0], flag), start, end, fields[2]))
    return DatasetGroup(name, tuple(entries))


def parse_weighted_split_paths(values: Sequence[str], flag: str) -> tuple[DatasetGroup, ...]:
    """One group per value; the train flag takes exactly one group, group names must be unique."""
    values = list(values)
    if not values:
        raise DataPathError(f"{flag}: expected at least one group 'NAME: W1 S1:E1 PATH1, ...'")
    if flag.startswith("--train") and len(values) != 1:
        raise DataPathError(f"{flag}: exactly one group is allowed, got {len(values)}")
    groups = tuple(parse_weighted_split_group(v, flag) for v in values)
    names = [g.name for g in groups]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise DataPathError(f"{flag}: group names must be unique, repeated: {', '.join(duplicates)}")
    return groups


def read_weighted_split_paths_file(path: str, flag: str) -> tuple[DatasetGroup, ...]:
    """The ``-path`` variants: a file of double-quoted groups ``"GROUP1" "GROUP2"`` (any spacing)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise DataPathError(f"{flag}: cannot read {path}: {exc.strerror}") from None
    try:
        values = shlex.split(text)
    except ValueError as exc:
        raise DataPathError(f"{flag}: {path}: unbalanced quotes ({exc})") from None
    if not values:
        raise DataPathError(f"{flag}: {path} holds no group")
    base_flag = flag[:-len("-path")] if flag.endswith("-path") else flag
    try:
        return parse_weighted_split_paths(values, base_flag)
    except DataPathError as exc:
        raise DataPathError(f"{flag} ({path}): {exc}") from None
