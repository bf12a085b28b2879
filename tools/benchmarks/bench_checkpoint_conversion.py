"""Time and peak memory of the checkpoint conversions on one checkpoint with optimizer states.

    python tools/benchmarks/bench_checkpoint_conversion.py --input_folder CKPT/global_stepN \\
        [--work_dir DIR] [--workers 1] [--skip_deepspeed]

Runs, each in its own process on the same input: our universal conversion
(tools/convert_checkpoint/ds_to_universal.py), DeepSpeed's own (deepspeed.checkpoint.ds_to_universal,
what Megatron-DeepSpeed's tool ran) and the transformers export (deepspeed_to_transformers.py, when
the model has a transformers architecture). Prints a table: seconds, peak resident memory of the
process (ru_maxrss: with one worker every conversion runs in that process) and bytes written.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEEPSPEED_CONVERSION = """
import argparse, sys
from deepspeed.checkpoint import ds_to_universal
ds_to_universal.main(argparse.Namespace(input_folder=sys.argv[1], output_folder=sys.argv[2],
    num_extract_workers=int(sys.argv[3]), num_merge_workers=int(sys.argv[3]), keep_temp_folder=False,
    strict=True, inject_missing_state=False))
"""


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def measured(command: list[str], log: str) -> tuple[float, float, int]:
    """(seconds, peak RSS in MB of the process, exit status) of ``command``; its output goes to ``log``."""
    started = time.perf_counter()
    with open(log, "w") as output:
        process = subprocess.Popen(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    if code:
        with open(log) as f:
            print(f"{' '.join(command)} failed:\n{f.read()[-3000:]}", file=sys.stderr)
    return seconds, usage.ru_maxrss / 1024, code


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input_folder", required=True, help="a global_stepN directory with optimizer states")
    parser.add_argument("--work_dir", default="/tmp/bench_checkpoint_conversion")
    parser.add_argument("--workers", type=int, default=1, help="conversion worker processes")
    parser.add_argument("--skip_deepspeed", action="store_true", help="do not run DeepSpeed's conversion")
    arguments = parser.parse_args(argv)
    shutil.rmtree(arguments.work_dir, ignore_errors=True)
    os.makedirs(arguments.work_dir)
    tools = os.path.join(REPO, "tools", "convert_checkpoint")
    workers = str(arguments.workers)
    runs = {"ours: universal": [sys.executable, os.path.join(tools, "ds_to_universal.py"), "--input_folder",
                                arguments.input_folder, "--output_folder",
                                os.path.join(arguments.work_dir, "ours", "universal"),
                                "--num_extract_workers", workers],
            "DeepSpeed: universal": [sys.executable, "-c", DEEPSPEED_CONVERSION, arguments.input_folder,
                                     os.path.join(arguments.work_dir, "deepspeed"), workers],
            "ours: transformers export": [sys.executable, os.path.join(tools, "deepspeed_to_transformers.py"),
                                          "--input_folder", arguments.input_folder, "--output_folder",
                                          os.path.join(arguments.work_dir, "hf")]}
    if arguments.skip_deepspeed:
        del runs["DeepSpeed: universal"]
    print(f"input: {arguments.input_folder}, {tree_bytes(arguments.input_folder) / 1e9:.2f} GB; "
          f"workers: {workers}; CPU cores: {os.cpu_count()}")
    print("| conversion | seconds | peak RSS (MB) | written (GB) |\n|---|---|---|---|")
    status = 0
    for name, command in runs.items():
        log = os.path.join(arguments.work_dir, re.sub(r"[^a-z]+", "_", name.lower()) + ".log")
        seconds, peak, code = measured(command, log)
        output = command[command.index("--output_folder") + 1] if "--output_folder" in command else command[-2]
        written = tree_bytes(output) / 1e9 if os.path.exists(output) else 0.0
        print(f"| {name} | {seconds:.1f} | {peak:.0f} | {written:.2f} |" + ("" if code == 0 else f" (exit {code})"))
        status |= code != 0 and name.startswith("ours")
        shutil.rmtree(output, ignore_errors=True)
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
