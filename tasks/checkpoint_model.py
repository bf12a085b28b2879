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
from megatron.core.checkpoint.reader import open_checkpoint
from megatron.core.evaluation.zeroshot import EvaluationInputError
from megatron.training.inference_model import (check_model_flags, checked_seq_length, checked_tokenizer, model_dtype,
                                               parse_inference_flags)

LAUNCH_VARIABLES = ("WORLD_SIZE", "SLURM_NTASKS")


@dataclass(frozen=True)
class CheckpointModel:
    """flags: the parsed command line; model: the checkpoint's GPTModel (logits over the padded
    vocabulary); tokenizer: the flags' tokenizer; seq_length: --seq-length, else the checkpoint's."""

    flags: object
    model: torch.nn.Module
    tokenizer: object
    seq_length: int


def load_checkpoint_model(argv, add_flags) -> CheckpointModel:
    """Parse ``argv`` (the trainer's flags plus those ``add_flags(parser)`` adds) and load the model
    of ``--load``; raises EvaluationInputError or inference_model's InferenceSetupError naming the
    flag. The flag, sequence-length and tokenizer checks are the generation tools' (inference_model.py)."""
    parser, flags = parse_inference_flags(argv, add_flags)
    if any(int(os.environ.get(name, "1")) > 1 for name in LAUNCH_VARIABLES):
        raise EvaluationInputError("launch the evaluation as one process (python, not torchrun or srun): it "
                                   "reads every TP and PP partition of the checkpoint into one model")
    if not flags.load:
        raise EvaluationInputError("give --load, the checkpoint directory")
    if not flags.micro_batch_size:
        raise EvaluationInputError("give --micro-batch-size, the samples of one forward")
    checkpoint = open_checkpoint(flags.load, "--load")
    check_model_flags(parser, flags, checkpoint)
    seq_length = checked_seq_length(flags, checkpoint)
    tokenizer = checked_tokenizer(flags, checkpoint)
    eval_fp32 = torch.float32 if getattr(flags, "eval_fp32", False) else None  # the harness's --eval_fp32
    model = load_gpt_model(checkpoint, **model_dtype(flags, eval_fp32))
    return CheckpointModel(flags, model, tokenizer, seq_length)
