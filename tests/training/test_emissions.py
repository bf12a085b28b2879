"""codecarbon's offline tracker writes an emissions CSV for a short tracked block, without network."""
import csv
import sys

import pytest

from megatron.training.emissions import EmissionsError, EmissionsTracker

pytest.importorskip("codecarbon")


def busy_work():
    return sum(i * i for i in range(200_000))


def test_tracked_block_writes_an_emissions_csv(tmp_path):
    output_dir = tmp_path / "codecarbon"  # created by the tracker
    tracker = EmissionsTracker(str(output_dir), rank=3, measure_power_secs=1.0)
    tracker.start()
    busy_work()
    tracker.flush()
    busy_work()
    emissions = tracker.stop()
    assert emissions >= 0.0
    path = output_dir / "emissions-003.csv"
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) >= 1
    last = rows[-1]
    assert last["country_iso_code"] == "FRA"
    assert float(last["duration"]) > 0.0
    assert float(last["energy_consumed"]) > 0.0
    assert float(last["emissions"]) == pytest.approx(emissions)


def test_unknown_country_is_refused(tmp_path):
    with pytest.raises(EmissionsError, match="'XYZ'"):
        EmissionsTracker(str(tmp_path), rank=0, country_iso_code="XYZ")


def test_stop_without_start_is_refused(tmp_path):
    tracker = EmissionsTracker(str(tmp_path), rank=0)
    with pytest.raises(EmissionsError, match="not started"):
        tracker.stop()


def test_missing_codecarbon_names_the_flag(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "codecarbon", None)  # import codecarbon now raises ImportError
    with pytest.raises(EmissionsError, match="--codecarbon-dir needs the codecarbon package"):
        EmissionsTracker(str(tmp_path), rank=0)
