"""The model of a training checkpoint for the evaluation commands, with Megatron-DeepSpeed's flags.

The command line is the trainer's (model, tokenizer, checkpoint and precision flags) plus the
command's own; the model configuration is read from the checkpoint, and a model flag given with a
value other than the checkpoint's is an error naming it. The weights are read with every TP and PP
partition merged (megatron.core.checkpoint.model_loading), so any saved layout runs here in one
process; a launch on several processes is refused. ``--load`` takes the ``--save`` directory (its
``latest``) or a ``global_stepN`` directory; the optimizer and RNG states are never read, so
``--no-load-optim`` and ``--no-load-rng`` are what happens anyway.
"""
import os
from dataclasses import dataclass

import torch

from megatron.core.checkpoint.model_loading import load_gpt_model
from megatron.core.checkpoint.reader import SavedCheckpoint, open_checkpoint, resolve_tag_directory
from megatron.core.evaluation.zeroshot import EvaluationInputError
from megatron.core.tokenizer import build_tokenizer
from megatron.training.arguments import build_parser

# Flags whose value must be the checkpoint's when given (dest = the saved configuration's key).
MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels",
               "max_position_embeddings", "position_embedding_type", "glu_activation", "embed_layernorm",
               "apply_residual_connection_post_layernorm", "openai_gelu", "layernorm_epsilon")
LAUNCH_VARIABLES = ("WORLD_SIZE", "SLURM_NTASKS")


@dataclass(frozen=True)
class CheckpointModel:
    """flags: the parsed command line; model: the checkpoint's GPTModel (logits over the padded
    vocabulary); tokenizer: the flags' tokenizer; seq_length: --seq-length, else the checkpoint's."""

    flags: object
    model: torch.nn.Module
    tokenizer: object
    seq_length: int


def parse_flags(argv, add_flags):
    parser = build_parser()
    add_flags(parser)
    return parser, parser.parse_args(argv)


def check_model_flags(parser, flags, checkpoint: SavedCheckpoint) -> None:
    for dest in MODEL_FLAGS:
        given, saved = getattr(flags, dest), checkpoint.model.get(dest)
        if given != parser.get_default(dest) and given != saved:
            raise EvaluationInputError(f"--{dest.replace('_', '-')} {given}: the checkpoint at --load "
                                       f"{checkpoint.directory} was trained with {saved}")


def precision(flags) -> dict:
    """The model's dtype override: fp32 with --eval_fp32, else --bf16 / --fp16, else the checkpoint's."""
    if getattr(flags, "eval_fp32", False):
        return {"params_dtype": torch.float32}
    if flags.bf16:
        return {"params_dtype": torch.bfloat16}
    if flags.fp16:
        return {"params_dtype": torch.float16}
    return {}


def load_checkpoint_model(argv, add_flags) -> CheckpointModel:
    """Parse ``argv`` (the trainer's flags plus those ``add_flags(parser)`` adds) and load the model
    of ``--load``; raises EvaluationInputError naming the flag."""
    parser, flags = parse_flags(argv, add_flags)
    if any(int(os.environ.get(name, "1")) > 1 for name in LAUNCH_VARIABLES):
        raise EvaluationInputError("launch the evaluation as one process (python, not torchrun or srun): it "
                                   "reads every TP and PP partition of the checkpoint into one model")
    if not flags.load:
        raise EvaluationInputError("give --load, the checkpoint directory")
    if not flags.micro_batch_size:
        raise EvaluationInputError("give --micro-batch-size, the samples of one forward")
    checkpoint = open_checkpoint(resolve_tag_directory(flags.load, "--load"))
    check_model_flags(parser, flags, checkpoint)
    seq_length = flags.seq_length or checkpoint.model["seq_length"]
    positions = checkpoint.model.get("max_position_embeddings")
    if positions and seq_length > positions:
        raise EvaluationInputError(f"--seq-length {seq_length}: the model has {positions} positions")
    tokenizer = build_tokenizer(flags.tokenizer_type, vocab_file=flags.vocab_file, merge_file=flags.merge_file,
                                tokenizer_name_or_path=flags.tokenizer_name_or_path)
    if tokenizer.vocab_size > checkpoint.model["padded_vocab_size"]:
        raise EvaluationInputError(f"the tokenizer has {tokenizer.vocab_size} tokens, the checkpoint's model "
                                   f"{checkpoint.model['padded_vocab_size']}: not the tokenizer it was trained with")
    model = load_gpt_model(checkpoint, **precision(flags))
    return CheckpointModel(flags, model, tokenizer, seq_length)
