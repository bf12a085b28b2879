"""tests/gpu/fp8_parity.py passes FP8 runs near the bf16 run and fails a final validation loss off by
more than 1 %, a loss spike over 10 % and a run that stopped early."""
from megatron.training.metrics import validation_log_lines
from tests.gpu.fp8_parity import main
from tests.gpu.test_compare_logs import log


def write(tmp_path, name: str, losses: dict[int, float], validation: float) -> str:
    path = tmp_path / f"{name}.log"
    path.write_text(log(losses) + "\n" + "\n".join(validation_log_lines("iteration 3", {"lm loss": validation})))
    return str(path)


def test_parity_passes_and_fails_on_what_it_must(tmp_path, capsys):
    bf16 = write(tmp_path, "bf16", {1: 10.0, 2: 8.0, 3: 6.0}, 6.10)
    close = write(tmp_path, "close", {1: 10.05, 2: 8.7, 3: 6.05}, 6.15)
    assert main([bf16, close]) == 0
    assert "close: final validation loss 6.1500 vs bf16 6.1000 (0.82 %" in capsys.readouterr().out
    off = write(tmp_path, "off", {1: 10.0, 2: 8.0, 3: 6.0}, 6.20)
    spike = write(tmp_path, "spike", {1: 10.0, 2: 8.9, 3: 6.0}, 6.10)
    short = write(tmp_path, "short", {1: 10.0, 2: 8.0}, 6.10)
    assert main([bf16, close, off]) == 1 and main([bf16, spike]) == 1 and main([bf16, short]) == 1
    output = capsys.readouterr().out
    assert "1 iterations over +10 % (first 2): FAIL" in output and "logged 2 of 3 iterations" in output
