"""Compare the iteration lines of trainer logs (the GPU acceptance runs of run_trainer.sh).

    python3 tests/gpu/compare_logs.py layouts --tolerance 2e-2 --first 5 A.log B.log ...
        losses and grad norms of iterations 1..first of every log against the first log
    python3 tests/gpu/compare_logs.py resume --tolerance 1e-3 REFERENCE.log SAVED.log RESUMED.log
        a run saved and stopped (SAVED) then resumed (RESUMED) against an uninterrupted REFERENCE:
        the resumed run starts at the saved iteration + 1 with the same consumed samples and
        learning rate, and its losses match the reference

Relative differences are |x - x_ref| / |x_ref|. Exit status 1 when a check fails.
"""
import argparse
import os
import re
import sys
from dataclasses import dataclass

from megatron.training.log_reader import iteration_records

LOADED = re.compile(r"successfully loaded checkpoint from .* at iteration (\d+)")
SAVED = re.compile(r"successfully saved checkpoint at iteration +(\d+)")


@dataclass(frozen=True)
class Step:
    iteration: int
    consumed_samples: int
    learning_rate: float
    loss: float
    grad_norm: float


def parse_steps(text: str) -> dict[int, Step]:
    """Iteration number -> Step, from every line the trainer logs at --log-interval 1."""
    return {record.iteration: Step(record.iteration, record.integer("consumed samples"),
                                   record.number("learning rate"), record.number("lm loss"),
                                   record.number("grad norm"))
            for record in iteration_records(text)}


def relative(value: float, reference: float) -> float:
    return abs(value - reference) / abs(reference)


def compare_layouts(runs: dict[str, dict[int, Step]], tolerance: float, first: int) -> tuple[list[str], bool]:
    """Report lines and whether iterations 1..first of every run match the first run's."""
    names = list(runs)
    reference = runs[names[0]]
    lines, worst_first, worst_all = [], 0.0, 0.0
    for iteration in sorted(reference):
        row = []
        for name in names:
            step = runs[name].get(iteration)
            if step is None:
                return lines + [f"{name} has no iteration {iteration}"], False
            difference = max(relative(step.loss, reference[iteration].loss),
                             relative(step.grad_norm, reference[iteration].grad_norm))
            worst_all = max(worst_all, difference)
            if iteration <= first:
                worst_first = max(worst_first, difference)
            row.append(f"{name} {step.loss:.6f}/{step.grad_norm:.4f}")
        lines.append(f"iteration {iteration}: " + "  ".join(row))
    if len(reference) < first:
        return lines + [f"{names[0]} logged {len(reference)} iterations, fewer than {first}"], False
    lines.append(f"largest relative loss or grad-norm difference to {names[0]}: iterations 1-{first} "
                 f"{worst_first:.2e} (tolerance {tolerance:.0e}), all iterations {worst_all:.2e}")
    return lines, worst_first <= tolerance


def compare_resume(reference: dict[int, Step], saved_text: str, resumed_text: str,
                   tolerance: float) -> tuple[list[str], bool]:
    """Report lines and whether the saved-then-resumed run continues the uninterrupted one."""
    saved_at = [int(m.group(1)) for m in SAVED.finditer(saved_text)]
    loaded_at = [int(m.group(1)) for m in LOADED.finditer(resumed_text)]
    resumed = parse_steps(resumed_text)
    if not saved_at or not loaded_at or not resumed:
        return [f"saved at {saved_at}, loaded at {loaded_at}, {len(resumed)} resumed iterations"], False
    lines = [f"saved at iterations {saved_at}, loaded at iteration {loaded_at[0]}, "
             f"resumed iterations {min(resumed)}-{max(resumed)}"]
    ok = loaded_at[0] in saved_at and min(resumed) == loaded_at[0] + 1
    worst = 0.0
    for iteration, step in sorted(resumed.items()):
        expected = reference.get(iteration)
        if expected is None:
            return lines + [f"the reference has no iteration {iteration}"], False
        same_counters = (step.consumed_samples, step.learning_rate) == (expected.consumed_samples,
                                                                        expected.learning_rate)
        ok = ok and same_counters
        worst = max(worst, relative(step.loss, expected.loss), relative(step.grad_norm, expected.grad_norm))
        lines.append(f"iteration {iteration}: consumed {step.consumed_samples}/{expected.consumed_samples} "
                     f"lr {step.learning_rate:.4E}/{expected.learning_rate:.4E} "
                     f"loss {step.loss:.6f}/{expected.loss:.6f} grad norm {step.grad_norm:.4f}/{expected.grad_norm:.4f}"
                     + ("" if same_counters else "  COUNTERS DIFFER"))
    first = min(resumed)
    lines.append(f"first resumed iteration {first}: relative loss difference "
                 f"{relative(resumed[first].loss, reference[first].loss):.2e}")
    lines.append(f"largest relative loss or grad-norm difference to the uninterrupted run: {worst:.2e} "
                 f"(tolerance {tolerance:.0e})")
    return lines, ok and worst <= tolerance


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.read()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    layouts = commands.add_parser("layouts")
    layouts.add_argument("--tolerance", type=float, required=True)
    layouts.add_argument("--first", type=int, default=5)
    layouts.add_argument("logs", nargs="+")
    resume = commands.add_parser("resume")
    resume.add_argument("--tolerance", type=float, required=True)
    resume.add_argument("reference")
    resume.add_argument("saved")
    resume.add_argument("resumed")
    args = parser.parse_args(argv)
    if args.command == "layouts":
        runs = {os.path.splitext(os.path.basename(path))[0]: parse_steps(_read(path)) for path in args.logs}
        lines, ok = compare_layouts(runs, args.tolerance, args.first)
    else:
        lines, ok = compare_resume(parse_steps(_read(args.reference)), _read(args.saved), _read(args.resumed),
                                   args.tolerance)
    print("\n".join(lines))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
