"""What the conversion tools share: opening the input (a checkpoint of this trainer without its
manifest only with --allow_missing_manifest, loudly), a per-layer progress bar around
megatron.core.checkpoint.writer (the model-only tools), and the summary and error reporting (all of
them: one line, no traceback, for a bad input or an output that cannot be written)."""
import argparse
import sys
import time

from megatron.core.checkpoint.output import OutputError, OutputExistsError
from megatron.core.checkpoint.reader import CheckpointInputError, SavedCheckpoint, open_checkpoint
from megatron.core.checkpoint.writer import resume_advice, write_model_checkpoint

ALLOW_MISSING_MANIFEST_HELP = ("read a checkpoint of this trainer whose manifest.json is missing, its files unverified "
                               "(a damaged file goes unnoticed); the output then gets no manifest either")


def layout_parser(description: str, input_help: str, output_help: str) -> argparse.ArgumentParser:
    """The flags of the tools that write a target layout: --input_folder, --output_folder, --target_tp, --target_pp."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--input_folder", required=True, help=input_help)
    parser.add_argument("--output_folder", required=True, help=output_help)
    parser.add_argument("--target_tp", type=int, default=1, help="tensor-parallel size of the output")
    parser.add_argument("--target_pp", type=int, default=1, help="pipeline-parallel size of the output")
    parser.add_argument("--allow_missing_manifest", action="store_true", help=ALLOW_MISSING_MANIFEST_HELP)
    return parser


def open_input(path: str, allow_missing_manifest: bool, flag: str = "--input_folder",
               read_optimizer: bool = False) -> SavedCheckpoint:
    """open_checkpoint, with its warning or notice on stderr when no manifest verified the input, and
    a notice when the FP8 state it holds is dropped."""
    checkpoint = open_checkpoint(path, flag, read_optimizer, allow_missing_manifest)
    for line in (checkpoint.unverified, checkpoint.fp8_notice):
        if line:
            print(line, file=sys.stderr)
    return checkpoint


def manifest_note(checkpoint: SavedCheckpoint) -> str:
    """What the summary says of an output written from unverified input, which has no manifest."""
    return "" if checkpoint.unverified is None else "; no manifest written (the input was read unverified)"


def reshape_with_progress(checkpoint: SavedCheckpoint, output: str, tp: int, pp: int, dp: int = 1,
                          flag: str = "--output_folder") -> str:
    """Write ``checkpoint`` at TP ``tp`` x PP ``pp`` under ``output``; returns the summary."""
    from tqdm import tqdm

    started = time.perf_counter()
    layers = checkpoint.model["num_layers"] + 2  # the embedding, the transformer layers, the final norm
    with tqdm(total=layers, desc="layers", unit="layer", file=sys.stderr) as bar:
        written = write_model_checkpoint(checkpoint, output, tp, pp, dp, on_layer=lambda _: bar.update(), flag=flag)
    return (f"iteration {checkpoint.iteration} (TP {checkpoint.tp}, PP {checkpoint.pp}) written at TP {tp}, PP {pp} to "
            f"{written.directory}/{written.tag}: {written.layers} layers in {time.perf_counter() - started:.1f} s, "
            f"weights only; {resume_advice(written, checkpoint.model['padded_vocab_size'])}{manifest_note(checkpoint)}")


def report(convert) -> int:
    """Run ``convert()`` and print its summary, or the error that stopped it; the exit status."""
    try:
        print(convert())
    except (CheckpointInputError, OutputExistsError, OutputError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
