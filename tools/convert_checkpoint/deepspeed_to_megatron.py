"""Write a checkpoint's weights in Megatron-LM's own layout (iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt).

    python tools/convert_checkpoint/deepspeed_to_megatron.py --input_folder CKPT[/global_stepN] \\
        --output_folder MEGATRON_CKPT [--target_tp 1] [--target_pp 1] [--for_release]

For tools that read Megatron-LM checkpoints. Weights only, with the model's configuration and the
counters in ``args``; --for_release writes a ``release`` checkpoint (iteration 0, counters zeroed).
The layout and what each file holds: megatron.core.checkpoint.megatron_lm.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.training.initialize import select_accelerator  # noqa: E402

select_accelerator()  # before anything imports deepspeed: one accelerator choice, no per-process guess

from megatron.core.checkpoint.megatron_lm import write_megatron_lm_checkpoint  # noqa: E402
from tools.convert_checkpoint.reshape import layout_parser, manifest_note, open_input, report  # noqa: E402


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = layout_parser(__doc__.split("\n")[0], "a global_stepN directory (or the --save directory)",
                           "the Megatron-LM checkpoint directory (must not exist)")
    parser.add_argument("--for_release", action="store_true",
                        help="a release checkpoint: iteration 0, consumed-sample counters zeroed")
    return parser.parse_args(argv)


def convert(arguments) -> str:
    from tqdm import tqdm

    started = time.perf_counter()
    checkpoint = open_input(arguments.input_folder, arguments.allow_missing_manifest)
    with tqdm(total=checkpoint.model["num_layers"] + 2, desc="layers", unit="layer", file=sys.stderr) as bar:
        written = write_megatron_lm_checkpoint(checkpoint, arguments.output_folder, arguments.target_tp,
                                               arguments.target_pp, arguments.for_release, lambda _: bar.update())
    return (f"iteration {checkpoint.iteration} (TP {checkpoint.tp}, PP {checkpoint.pp}) written in Megatron-LM's layout "
            f"at TP {written.tp}, PP {written.pp} to {written.directory}/{written.iteration_directory} "
            f"(padded vocabulary {written.padded_vocab_size}) in {time.perf_counter() - started:.1f} s, weights only"
            f"{manifest_note(checkpoint)}")


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    return report(lambda: convert(arguments))


if __name__ == "__main__":
    sys.exit(main())
