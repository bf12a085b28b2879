"""Parsing of --data-path, --split and the named weighted-split groups (and their -path files)."""
import pytest

from megatron.core.data.data_paths import (DataPathError, DatasetGroup, GroupEntry,
                                           WeightedPrefix, parse_data_path, parse_split,
                                           parse_weighted_split_paths, range_document_boundaries,
                                           read_weighted_split_paths_file,
                                           split_document_boundaries)


def test_data_path_single_and_weighted():
    assert parse_data_path(["/data/a_text_document"]) == (WeightedPrefix(1.0, "/data/a_text_document"),)
    assert parse_data_path(["0.3", "A", "0.7", "B"]) == (WeightedPrefix(0.3, "A"), WeightedPrefix(0.7, "B"))


@pytest.mark.parametrize("values,message", [
    ([], "got nothing"),
    (["0.3", "A", "0.7"], "'0.7', has no partner"),
    (["x", "A", "0.7", "B"], "expected a weight, got 'x'"),
    (["-1", "A", "2", "B"], "weight '-1' must be a positive"),
])
def test_data_path_errors_name_flag_and_token(values, message):
    with pytest.raises(DataPathError, match=r"^--data-path: .*" + message.replace("(", r"\(")):
        parse_data_path(values)


@pytest.mark.parametrize("text,expected", [
    ("969, 30, 1", (0.969, 0.030, 0.001)),
    ("969,30,1", (0.969, 0.030, 0.001)),
    ("98/1/1", (0.98, 0.01, 0.01)),
    ("80,20", (0.8, 0.2, 0.0)),
    ("1", (1.0, 0.0, 0.0)),
])
def test_split_proportions(text, expected):
    assert parse_split(text) == pytest.approx(expected)


@pytest.mark.parametrize("text,message", [
    ("9,x,1", "'x' in '9,x,1' is not a number"),
    ("1,2,3,4", "at most 3"),
    ("0,0,0", "sum to zero"),
    ("5,-1,1", "must be >= 0"),
])
def test_split_errors(text, message):
    with pytest.raises(DataPathError, match="--split: .*" + message):
        parse_split(text)


def test_split_document_boundaries_follow_megatron_rounding():
    assert split_document_boundaries(parse_split("969, 30, 1"), 1000) == [0, 969, 999, 1000]
    # round(0.5 * 3) + round(0.5 * 3) = 4 > 3: the excess comes off the later boundaries.
    assert split_document_boundaries((0.5, 0.5, 0.0), 3) == [0, 1, 3, 3]
    # 3 + 3 + 3 = 9 < 10: the deficit is added to every boundary after the first.
    assert split_document_boundaries(parse_split("1/1/1"), 10) == [0, 4, 7, 10]
    assert split_document_boundaries(parse_split("969, 30, 1"), 10) == [0, 10, 10, 10]


def test_range_document_boundaries():
    assert range_document_boundaries(0.0, 0.8, 100) == (0, 80)
    assert range_document_boundaries(0.95, 1.0, 7) == (7, 7)


def test_weighted_split_groups():
    groups = parse_weighted_split_paths(
        ["VALID1: 1 0.8:0.9 /d/a, 2 0.9:1 /d/b", "VALID2:0.5 0:1 /d/c"],
        "--valid-weighted-split-paths")
    assert groups == (
        DatasetGroup("VALID1", (GroupEntry(1.0, 0.8, 0.9, "/d/a"), GroupEntry(2.0, 0.9, 1.0, "/d/b"))),
        DatasetGroup("VALID2", (GroupEntry(0.5, 0.0, 1.0, "/d/c"),)),
    )


@pytest.mark.parametrize("values,message", [
    (["TRAIN: 1 0:0.5 A", "OTHER: 1 0:1 B"], "exactly one group is allowed, got 2"),
    (["1 0:0.5 A"], "must start with 'NAME:'"),
    (["TRAIN: 1 0:0.5"], "expected 'WEIGHT START:END PATH', got '1 0:0.5'"),
    (["TRAIN: 1 0.5:0.2 A"], "range '0.5:0.2' must satisfy 0 <= START < END <= 1"),
    (["TRAIN: 1 0-0.5 A"], "expected a document range START:END, got '0-0.5'"),
    (["TRAIN: heavy 0:1 A"], "expected a weight, got 'heavy'"),
    (["TRAIN: 1 a:b A"], "range 'a:b' must be two numbers"),
])
def test_weighted_split_errors(values, message):
    with pytest.raises(DataPathError, match="--train-weighted-split-paths: .*" + message):
        parse_weighted_split_paths(values, "--train-weighted-split-paths")


def test_duplicate_group_names_rejected():
    with pytest.raises(DataPathError, match="repeated: V"):
        parse_weighted_split_paths(["V: 1 0:1 A", "V: 1 0:1 B"], "--valid-weighted-split-paths")


def test_weighted_split_paths_file(tmp_path):
    path = tmp_path / "valid.txt"
    path.write_text('"VALID1: 1 0.8:0.9 /d/a, 2 0.9:1 /d/b" "VALID2: 1 0:1 /d/c"\n')
    groups = read_weighted_split_paths_file(str(path), "--valid-weighted-split-paths-path")
    assert [g.name for g in groups] == ["VALID1", "VALID2"]
    assert groups[0].entries[1] == GroupEntry(2.0, 0.9, 1.0, "/d/b")


def test_weighted_split_paths_file_errors(tmp_path):
    flag = "--train-weighted-split-paths-path"
    with pytest.raises(DataPathError, match=f"{flag}: cannot read .*missing.txt"):
        read_weighted_split_paths_file(str(tmp_path / "missing.txt"), flag)
    unbalanced = tmp_path / "unbalanced.txt"
    unbalanced.write_text('"TRAIN: 1 0:1 A\n')
    with pytest.raises(DataPathError, match="unbalanced quotes"):
        read_weighted_split_paths_file(str(unbalanced), flag)
    two = tmp_path / "two.txt"
    two.write_text('"A: 1 0:1 X" "B: 1 0:1 Y"\n')
    with pytest.raises(DataPathError, match=f"{flag} \\(.*two.txt\\): .*exactly one group"):
        read_weighted_split_paths_file(str(two), flag)
