"""Convert a checkpoint into DeepSpeed's universal checkpoint, which resumes under any TP, PP and DP.

    python tools/convert_checkpoint/ds_to_universal.py --input_folder CKPT/global_stepN \\
        --output_folder CKPT/global_stepN_universal [--num_extract_workers 4] [--num_merge_workers 2]
    pretrain_gpt.py ... --load CKPT --universal-checkpoint      # any --tensor/--pipeline-model-parallel-size

The universal checkpoint holds, per parameter, the full fp32 weight and the Adam moments
(``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``) and the source's model-states files (the
counters and the LR schedule); ``latest_universal`` in the output's parent names it.

The format is DeepSpeed's (``deepspeed.checkpoint.ds_to_universal`` writes it, ``load_universal``
reads it); the conversion is ours (megatron.core.checkpoint.universal_writer), because DeepSpeed's
loads every optimizer partition whole and its memory grows with the model, where ours reads one
layer at a time. Besides, this tool
  - checks the input first: every file against the manifest (size, CRC-32), the trainer state, and
    that it holds an optimizer state it can name: ZeRO partitions (stage 1 or 2, which bf16 and fp16
    runs always use), or at stage 0 (fp32) the torch optimizer state with the trainer's
    optimizer_parameter_names (checkpoints of earlier trainers lack them and are refused);
  - keeps the padded vocabulary: DeepSpeed's conversion cuts the word embeddings to the tokenizer's
    vocabulary and loads zeros into the padding rows, which the softmax sees, so the resumed loss
    would drift from the uninterrupted run's. Kept, the rows resume exactly; a target whose padded
    vocabulary is smaller is refused at load with the --pad-vocab-size-to that keeps them. The
    model-states files record it (their universal_checkpoint_info);
  - names every parameter as the pipeline module does, whichever engine saved it, so either engine
    resumes it (DeepSpeed keeps the saving module's names);
  - takes in a checkpoint written by Megatron-DeepSpeed (megatron.core.checkpoint.megatron_deepspeed):
    its model-states files are read translated, its three optimizer groups become the trainer's two
    and its parameter names ours;
  - writes into a hidden directory that is renamed when complete, with a manifest of every file (none
    when the input had none: --allow_missing_manifest), and writes ``latest_universal`` last. A
    failed conversion leaves no output; an output that cannot be written is named in one line.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.training.initialize import select_accelerator  # noqa: E402

select_accelerator()  # before anything imports deepspeed: one accelerator choice, no per-process guess

import torch  # noqa: E402

from megatron.core.checkpoint import megatron_deepspeed  # noqa: E402
from megatron.core.checkpoint.latest import UNIVERSAL_LATEST, write_universal_latest  # noqa: E402
from megatron.core.checkpoint.output import (output_errors, save_torch_file, staged_directory,  # noqa: E402
                                             tree_size, write_tree_manifest)
from megatron.core.checkpoint.reader import resolve_tag_directory  # noqa: E402
from megatron.core.checkpoint.universal import UNIVERSAL_CHECKPOINT_INFO, universal_info  # noqa: E402
from megatron.core.checkpoint.universal_writer import write_universal_zero  # noqa: E402
from tools.convert_checkpoint.reshape import (ALLOW_MISSING_MANIFEST_HELP, manifest_note, open_input,  # noqa: E402
                                              report)


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input_folder", required=True, help="a global_stepN directory (or the --save directory)")
    parser.add_argument("--output_folder", required=True, help="conventionally CKPT/global_stepN_universal")
    parser.add_argument("--num_extract_workers", type=int, default=4,
                        help="processes converting layers side by side (each holds one layer's states)")
    parser.add_argument("--num_merge_workers", type=int, default=2,
                        help="accepted for Megatron-DeepSpeed's scripts: each worker merges the layer it extracts")
    parser.add_argument("--allow_missing_manifest", action="store_true", help=ALLOW_MISSING_MANIFEST_HELP)
    return parser.parse_args(argv)


def write_model_states(checkpoint, output: str) -> None:
    """The source's model-states files, their parameter patterns keeping the padded vocabulary
    (module docstring)."""
    padded = checkpoint.model["padded_vocab_size"]
    info = universal_info(checkpoint.sharding, checkpoint.pipeline, padded_vocab_size=padded,
                          original_vocab_size=padded)
    for name in os.listdir(checkpoint.directory):
        if name.startswith("mp_rank_"):
            state = torch.load(os.path.join(checkpoint.directory, name), map_location="cpu", weights_only=False,
                               mmap=True)
            save_torch_file({**state, UNIVERSAL_CHECKPOINT_INFO: info}, os.path.join(output, name))


def take_in_megatron_deepspeed(output: str) -> None:
    """Megatron-DeepSpeed's parameter names and optimizer groups made ours in ``output``/zero: its three
    groups merged into our two (the universal loader gives our groups the saved groups' settings in
    order), its embedding LayerNorm's folders renamed (megatron.core.checkpoint.megatron_deepspeed)."""
    megatron_deepspeed.rename_universal_parameters(os.path.join(output, "zero"))
    path = os.path.join(output, "zero", "optimizer_state.pt")
    state = torch.load(path, map_location="cpu", weights_only=False)
    state["param_groups"] = megatron_deepspeed.merge_parameter_groups(state["param_groups"])
    state["optimizer_state_dict"]["param_groups"] = state["param_groups"]  # where ZeRO-3's load reads them
    torch.save(state, path)


def convert(arguments) -> str:
    """The whole conversion; returns the summary line."""
    from tqdm import tqdm

    started = time.perf_counter()
    output = os.path.normpath(arguments.output_folder)
    with megatron_deepspeed.translated_input(resolve_tag_directory(arguments.input_folder),
                                             os.path.dirname(output) or ".") as input_folder:
        checkpoint = open_input(input_folder, arguments.allow_missing_manifest, read_optimizer=True)
        foreign = megatron_deepspeed.is_translated(checkpoint.state)
        layers = checkpoint.model["num_layers"] + 2
        with staged_directory(output) as staging, \
                tqdm(total=layers, desc="layers", unit="layer", file=sys.stderr) as bar:
            write_universal_zero(checkpoint, staging, arguments.num_extract_workers, bar.update)
            if foreign:
                take_in_megatron_deepspeed(staging)
            write_model_states(checkpoint, staging)
            if checkpoint.unverified is None:  # no manifest vouches for unverified input
                write_tree_manifest(staging, checkpoint.iteration)
    with output_errors(output, "--output_folder"):
        write_universal_latest(os.path.dirname(output) or ".", os.path.basename(output))
    files = sum(len(names) for _, _, names in os.walk(output))
    return (f"universal checkpoint of iteration {checkpoint.iteration} (saved at TP {checkpoint.tp}, PP "
            f"{checkpoint.pp}, DP {checkpoint.dp}) written to {output}: {files} files, "
            f"{tree_size(output) / 1e9:.3f} GB in {time.perf_counter() - started:.1f} s; "
            f"{UNIVERSAL_LATEST} names it. Resume with --load {os.path.dirname(output) or '.'} --universal-checkpoint"
            f"{manifest_note(checkpoint)}")


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    return report(lambda: convert(arguments))


if __name__ == "__main__":
    sys.exit(main())
