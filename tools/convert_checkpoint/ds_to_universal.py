"""Convert a checkpoint into DeepSpeed's universal checkpoint, which resumes under any TP, PP and DP.

    python tools/convert_checkpoint/ds_to_universal.py --input_folder CKPT/global_stepN \\
        --output_folder CKPT/global_stepN_universal [--num_extract_workers 4] [--num_merge_workers 2]
    pretrain_gpt.py ... --load CKPT --universal-checkpoint      # any --tensor/--pipeline-model-parallel-size

The universal checkpoint holds, per parameter, the full fp32 weight and the Adam moments
(``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``) and the source's model-states files (the
counters and the LR schedule); ``latest_universal`` in the output's parent names it.

The conversion is DeepSpeed's own (``deepspeed.checkpoint.ds_to_universal``); around it this tool
  - checks the input first: every file against the manifest (size, CRC-32), the trainer state, and
    that ZeRO partitioned the optimizer (stage 1 or 2: DeepSpeed reads the optimizer only from such
    partitions, and restores a universal checkpoint only into a ZeRO optimizer);
  - gives DeepSpeed the parameter patterns (megatron.core.checkpoint.universal), with the padded
    vocabulary as the size to keep: DeepSpeed would cut the word embeddings to the tokenizer's
    vocabulary and load zeros into the padding rows, which the softmax sees, so the resumed loss
    would drift from the uninterrupted run's. Kept, the rows resume exactly; a target whose padded
    vocabulary is smaller is refused at load with the --pad-vocab-size-to that keeps them;
  - names every parameter as the pipeline module does, whichever engine saved it, so either engine
    resumes it (DeepSpeed keeps the saving module's names);
  - writes into a hidden directory that is renamed when complete, with a manifest of every file, and
    writes ``latest_universal`` last. A failed conversion leaves no output.
"""
import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from megatron.core.checkpoint.names import pipeline_name  # noqa: E402
from megatron.core.checkpoint.output import (staged_directory, tree_size, write_pointer,  # noqa: E402
                                             write_tree_manifest)
from megatron.core.checkpoint.reader import CheckpointInputError, open_checkpoint  # noqa: E402
from megatron.core.checkpoint.universal import UNIVERSAL_CHECKPOINT_INFO, universal_checkpoint_info  # noqa: E402
from tools.convert_checkpoint.reshape import report  # noqa: E402

UNIVERSAL_LATEST = "latest_universal"


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input_folder", required=True, help="a global_stepN directory (or the --save directory)")
    parser.add_argument("--output_folder", required=True, help="conventionally CKPT/global_stepN_universal")
    parser.add_argument("--num_extract_workers", type=int, default=4,
                        help="processes extracting the ZeRO fragments")
    parser.add_argument("--num_merge_workers", type=int, default=2,
                        help="processes merging the TP slices (each holds one parameter's slices)")
    return parser.parse_args(argv)


def staged_input(checkpoint, staging: str) -> str:
    """The input DeepSpeed reads: links to the checkpoint's files, with copies of its model-states
    files whose parameter patterns keep the padded vocabulary (module docstring)."""
    patched = os.path.join(staging, "input")
    os.makedirs(patched)
    padded = checkpoint.model["padded_vocab_size"]
    info = universal_checkpoint_info(checkpoint.glu, checkpoint.model["position_embedding_type"] == "absolute",
                                     checkpoint.pipeline, padded_vocab_size=padded, original_vocab_size=padded)
    for name in os.listdir(checkpoint.directory):
        source = os.path.join(checkpoint.directory, name)
        if name.startswith("mp_rank_"):
            state = torch.load(source, map_location="cpu", weights_only=False)
            torch.save({**state, UNIVERSAL_CHECKPOINT_INFO: info}, os.path.join(patched, name))
        else:
            os.symlink(os.path.abspath(source), os.path.join(patched, name))
    return patched


def rename_to_pipeline_names(zero_directory: str, num_layers: int) -> None:
    """The plain engine's parameter folders (``layers.0.mlp...``) under their pipeline names (``3.mlp...``)."""
    for name in os.listdir(zero_directory):
        path = os.path.join(zero_directory, name)
        if os.path.isdir(path):
            os.rename(path, os.path.join(zero_directory, pipeline_name(name, num_layers)))


def run_deepspeed_conversion(input_folder: str, output_folder: str, arguments) -> None:
    from deepspeed.checkpoint import ds_to_universal

    ds_to_universal.main(argparse.Namespace(
        input_folder=input_folder, output_folder=output_folder, num_extract_workers=arguments.num_extract_workers,
        num_merge_workers=arguments.num_merge_workers, keep_temp_folder=False, strict=True,
        inject_missing_state=False))


def convert(arguments) -> str:
    """The whole conversion; returns the summary line."""
    started = time.perf_counter()
    checkpoint = open_checkpoint(arguments.input_folder, read_optimizer=True)
    if not checkpoint.optimizer_files:
        raise CheckpointInputError(
            f"{checkpoint.directory} has no ZeRO optimizer partitions (*zero_pp_rank_*_optim_states.pt): it was saved "
            f"at ZeRO stage 0, whose optimizer state DeepSpeed's universal conversion cannot read. Save with "
            f"--zero-stage 1 (it costs no memory over stage 0 at data-parallel size 1)")
    output = os.path.normpath(arguments.output_folder)
    with staged_directory(output) as staging:
        source = staged_input(checkpoint, staging)
        converted = os.path.join(staging, "universal")
        run_deepspeed_conversion(source, converted, arguments)
        if not checkpoint.pipeline:
            rename_to_pipeline_names(os.path.join(converted, "zero"), checkpoint.model["num_layers"])
        # DeepSpeed pointed a latest_universal of the staging directory at its folder: ours comes last
        os.remove(os.path.join(staging, UNIVERSAL_LATEST))
        files = write_tree_manifest(converted, checkpoint.iteration)
        for name in os.listdir(converted):
            os.replace(os.path.join(converted, name), os.path.join(staging, name))
        for leftover in ("universal", "input"):
            if os.path.lexists(os.path.join(staging, leftover)):
                shutil.rmtree(os.path.join(staging, leftover))
    write_pointer(os.path.join(os.path.dirname(output) or ".", UNIVERSAL_LATEST), os.path.basename(output))
    return (f"universal checkpoint of iteration {checkpoint.iteration} (saved at TP {checkpoint.tp}, PP "
            f"{checkpoint.pp}, DP {checkpoint.dp}) written to {output}: {files} files, "
            f"{tree_size(output) / 1e9:.3f} GB in {time.perf_counter() - started:.1f} s; "
            f"{UNIVERSAL_LATEST} names it. Resume with --load {os.path.dirname(output) or '.'} --universal-checkpoint")


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    return report(lambda: convert(arguments))


if __name__ == "__main__":
    sys.exit(main())
