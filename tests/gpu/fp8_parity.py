"""The FP8 loss-parity check of run_trainer.sh (issue 35): FP8 runs against the bf16 run of the same
model, data order and seed.

    python3 tests/gpu/fp8_parity.py BF16.log FP8.log [FP8.log ...]

For each FP8 log: its last validation loss within 1 % of the bf16 run's last one, and no iteration
whose training loss exceeds bf16's at the same iteration by more than 10 % (a spike). Every run must
have logged the same iterations as the bf16 run. Exit status 1 when a check fails.
"""
import argparse
import os
import sys

from megatron.training.log_reader import read_log

FINAL_VALIDATION_RTOL, SPIKE_RATIO = 0.01, 1.10


def _curve_and_final(path: str) -> tuple[dict[int, float], float | None]:
    with open(path, encoding="utf-8", errors="replace") as handle:
        log = read_log(handle.read())
    curve = {record.iteration: record.number("lm loss") for record in log.iterations}
    validations = [record for record in log.validations if record.kind == "validation"]
    return curve, validations[-1].loss if validations else None


def check(reference: str, candidate: str) -> tuple[list[str], bool]:
    """(report lines, passed) of ``candidate``'s log against the bf16 ``reference``'s."""
    name = os.path.splitext(os.path.basename(candidate))[0]
    bf16, bf16_final = _curve_and_final(reference)
    fp8, fp8_final = _curve_and_final(candidate)
    if not fp8 or fp8.keys() != bf16.keys() or fp8_final is None or bf16_final is None:
        return [f"{name}: FAIL: iterations or validation loss missing (logged {len(fp8)} of {len(bf16)} "
                f"iterations)"], False
    spikes = [iteration for iteration in sorted(bf16) if fp8[iteration] > SPIKE_RATIO * bf16[iteration]]
    worst = max(sorted(bf16), key=lambda iteration: fp8[iteration] / bf16[iteration])
    difference = abs(fp8_final - bf16_final) / bf16_final
    passed = difference <= FINAL_VALIDATION_RTOL and not spikes
    lines = [f"{name}: final validation loss {fp8_final:.4f} vs bf16 {bf16_final:.4f} ({100 * difference:.2f} %, "
             f"limit 1 %); largest loss ratio {fp8[worst] / bf16[worst]:.4f} at iteration {worst}; "
             f"{len(spikes)} iterations over +10 %{' (first ' + str(spikes[0]) + ')' if spikes else ''}: "
             f"{'PASS' if passed else 'FAIL'}"]
    return lines, passed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bf16")
    parser.add_argument("fp8", nargs="+")
    args = parser.parse_args(argv)
    ok = True
    for candidate in args.fp8:
        lines, passed = check(args.bf16, candidate)
        print("\n".join(lines))
        ok = ok and passed
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
