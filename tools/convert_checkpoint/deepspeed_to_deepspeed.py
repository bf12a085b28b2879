"""Reshape a checkpoint to another TP, PP and DP size, weights only.

    python tools/convert_checkpoint/deepspeed_to_deepspeed.py --input_folder CKPT[/global_stepN] \\
        --output_folder NEW --target_tp 2 --target_pp 4 [--target_dp 1]

NEW is a --save directory: ``global_stepN`` with the layer files at the target TP size, one
model-states file per (stage, TP rank) carrying the counters and the LR schedule, a manifest,
``latest``. Optimizer and RNG states are not carried (megatron.core.checkpoint.writer says why and
how to resume); to move the optimizer state too, use ds_to_universal.py and --universal-checkpoint.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.training.initialize import select_accelerator  # noqa: E402

select_accelerator()  # before anything imports deepspeed: one accelerator choice, no per-process guess

from tools.convert_checkpoint.reshape import layout_parser, open_input, report, reshape_with_progress  # noqa: E402


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = layout_parser(__doc__.split("\n")[0], "a global_stepN directory (or the --save directory)",
                           "the new --save directory (must not exist)")
    parser.add_argument("--target_dp", type=int, default=1,
                        help="data-parallel size recorded in the output (no optimizer state depends on it)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    return report(lambda: reshape_with_progress(open_input(arguments.input_folder, arguments.allow_missing_manifest),
                                                arguments.output_folder, arguments.target_tp, arguments.target_pp,
                                                arguments.target_dp))


if __name__ == "__main__":
    sys.exit(main())
