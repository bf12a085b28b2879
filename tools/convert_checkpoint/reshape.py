"""What the conversion tools share: a per-layer progress bar around megatron.core.checkpoint.writer
(the model-only tools), and the summary and error reporting (all of them)."""
import argparse
import sys
import time

from megatron.core.checkpoint.output import OutputExistsError
from megatron.core.checkpoint.reader import CheckpointInputError, SavedCheckpoint
from megatron.core.checkpoint.writer import resume_advice, write_model_checkpoint


def layout_parser(description: str, input_help: str, output_help: str) -> argparse.ArgumentParser:
    """The flags of the tools that write a target layout: --input_folder, --output_folder, --target_tp, --target_pp."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--input_folder", required=True, help=input_help)
    parser.add_argument("--output_folder", required=True, help=output_help)
    parser.add_argument("--target_tp", type=int, default=1, help="tensor-parallel size of the output")
    parser.add_argument("--target_pp", type=int, default=1, help="pipeline-parallel size of the output")
    return parser


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
            f"weights only; {resume_advice(written, checkpoint.model['padded_vocab_size'])}")


def report(convert) -> int:
    """Run ``convert()`` and print its summary, or the error that stopped it; the exit status."""
    try:
        print(convert())
    except (CheckpointInputError, OutputExistsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
