"""tools/benchmarks/scaling_table.py: steady-state means of trainer log lines and the ratio to one GPU."""
import pytest

from tools.benchmarks.scaling_table import main, pipeline_bound

LINE = (" iteration {it:8d}/      10 | consumed samples: {samples:12d} | consumed tokens: {tokens:12d} | "
        "elapsed time per iteration (s): {seconds:.2f} | learning rate: 1.000E-05 | global batch size:    64 | "
        "lm loss: 9.387344E+00 | grad norm: 3.282 | number of skipped iterations:   0 | "
        "number of nan iterations:   0 | samples per second: 27.526 | TFLOPs: 502.82 | "
        "model TFLOP/s: {tflops:.2f} | MFU: 65.79% |")


def _log(tmp_path, name, per_iteration):
    lines = [LINE.format(it=it, samples=64 * it, tokens=64 * 2048 * it, seconds=seconds, tflops=tflops)
             for it, (seconds, tflops) in enumerate(per_iteration, start=1)]
    path = tmp_path / f"{name}.log"
    path.write_text("[default0]:" + "\n[default0]:".join(lines) + "\n")
    return str(path)


def test_table_of_steady_state_means_against_the_first_run(tmp_path, capsys):
    single = _log(tmp_path, "single", [(9.0, 1.0), (2.0, 500.0), (2.0, 520.0), (2.0, 540.0)])
    tp2 = _log(tmp_path, "tp2", [(9.0, 1.0), (1.0, 400.0), (1.0, 410.0), (1.0, 420.0)])
    pp2 = _log(tmp_path, "pp2", [(9.0, 1.0), (1.0, 450.0), (1.0, 480.0)])
    assert main(["--skip", "1", f"1gpu={single}", f"tp2={tp2}", f"pp2:8={pp2}"]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert rows[0] == "| 1gpu | 3 | 2.000 | 520.0 | 100.0% |  |"
    assert rows[1] == "| tp2 | 3 | 1.000 | 410.0 | 78.8% |  |"
    assert rows[2] == "| pp2:8 | 2 | 1.000 | 465.0 | 89.4% | 88.9% |"


def test_pipeline_bound_and_missing_steady_state(tmp_path, capsys):
    assert pipeline_bound("pp4:8") == pytest.approx(1 - 3 / 11)
    assert pipeline_bound("tp2") is None
    short = _log(tmp_path, "short", [(9.0, 1.0)])
    assert main(["--skip", "3", f"1gpu={short}"]) == 1
    assert "no iteration line after iteration 3" in capsys.readouterr().err
