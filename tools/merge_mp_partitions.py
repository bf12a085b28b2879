"""Merge the tensor-parallel partitions of a checkpoint into TP = 1, at a target pipeline size.

    python tools/merge_mp_partitions.py --model-type GPT --tensor-model-parallel-size 2 \\
        --target-pipeline-model-parallel-size 1 --load CKPT --save MERGED [model flags]

Megatron-DeepSpeed's flags: --load is the checkpoint (its ``latest`` or a global_stepN directory),
--tensor-model-parallel-size its TP size (checked against the checkpoint), --save the new --save
directory, written at TP 1 and --target-pipeline-model-parallel-size (default 1). Model flags
scripts pass along (--num-layers, --hidden-size, --num-attention-heads, ...) are checked against
the model the checkpoint records; other training flags are ignored, since the checkpoint decides.
The weights only (megatron.core.checkpoint.writer): resume with --no-load-optim --no-load-rng or
--finetune.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.initialize import select_accelerator  # noqa: E402

select_accelerator()  # before anything imports deepspeed: one accelerator choice, no per-process guess

from megatron.core.checkpoint.reader import CheckpointInputError  # noqa: E402
from tools.convert_checkpoint.reshape import (ALLOW_MISSING_MANIFEST_HELP, open_input, report,  # noqa: E402
                                              reshape_with_progress)

CHECKED_MODEL_FLAGS = {"--num-layers": "num_layers", "--hidden-size": "hidden_size",
                       "--num-attention-heads": "num_attention_heads", "--ffn-hidden-size": "ffn_hidden_size",
                       "--max-position-embeddings": "max_position_embeddings", "--seq-length": "seq_length",
                       "--num-query-groups": "num_query_groups", "--num-key-value-heads": "num_query_groups"}


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-type", required=True, choices=["GPT"], help="GPT (the only model trained here)")
    parser.add_argument("--tensor-model-parallel-size", type=int, required=True,
                        help="the TP size the checkpoint was saved with")
    parser.add_argument("--target-pipeline-model-parallel-size", type=int, default=1,
                        help="pipeline-parallel size of the merged checkpoint")
    parser.add_argument("--load", required=True, help="the checkpoint to merge")
    parser.add_argument("--save", required=True, help="the new --save directory (must not exist)")
    parser.add_argument("--allow-missing-manifest", action="store_true", help=ALLOW_MISSING_MANIFEST_HELP)
    for flag in CHECKED_MODEL_FLAGS:
        parser.add_argument(flag, type=int, default=None, help="checked against the checkpoint's model")
    arguments, ignored = parser.parse_known_args(argv)
    if ignored:
        print(f"note: ignored (the checkpoint records the model and the run): {' '.join(ignored)}", file=sys.stderr)
    return arguments


def saved_model_field(model: dict, field: str):
    """The checkpoint's ``field``; key/value groups default to the heads (a model saved before grouped-query
    attention has one group per head)."""
    if field == "num_query_groups":
        return model.get(field) or model["num_attention_heads"]
    return model[field]


def merge(arguments) -> str:
    checkpoint = open_input(arguments.load, arguments.allow_missing_manifest, "--load")
    if checkpoint.tp != arguments.tensor_model_parallel_size:
        raise CheckpointInputError(f"--tensor-model-parallel-size {arguments.tensor_model_parallel_size}: {arguments.load} "
                                   f"was saved with TP {checkpoint.tp}")
    for flag, field in CHECKED_MODEL_FLAGS.items():
        given = getattr(arguments, flag[2:].replace("-", "_"))
        saved = saved_model_field(checkpoint.model, field)
        if given is not None and given != saved:
            raise CheckpointInputError(f"{flag} {given}: the checkpoint's model has {saved}")
    return reshape_with_progress(checkpoint, arguments.save, 1, arguments.target_pipeline_model_parallel_size,
                                 flag="--save")


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    return report(lambda: merge(arguments))


if __name__ == "__main__":
    sys.exit(main())
