"""Flags that are recognised and refused, each with its reason: the one table, REJECTED_FLAGS.

A flag we accept must work (docs/architecture.md, "Principles"), so every Megatron-DeepSpeed flag
whose feature we lack, that was a no-op there, or that belongs to another model type is refused
at parse time with a message that says why and what to do instead. The flags are hidden from ``--help``.
The table below covers Megatron-DeepSpeed (BigScience); the flags of Megatron-LM and of Microsoft's
Megatron-DeepSpeed join it from argument_foreign_flags.py, which also registers the foreign spellings
that are accepted.

| Flags | Why refused |
|---|---|
| --reset-progress | the feature comes with the long-run work (progress reset) |
| --inference | builds a model without optimizer for the generation tools; pretraining always trains |
| --batch-size, --warmup, --model-parallel-size | deprecated in Megatron-DeepSpeed, which asserted with these messages |
| --zero-reduce-scatter, --zero-contigious-gradients, --zero-reduce-bucket-size, --zero-allgather-bucket-size | no-ops in Megatron-DeepSpeed: the ds_config's zero_optimization block decides |
| --scattered-embeddings, --memory-centric-tiled-linear, --tile-factor, --split-transformers | no-ops in Megatron-DeepSpeed |
| --contigious-checkpointing, --checkpoint-in-cpu, --synchronize-each-layer, --profile-backward | DeepSpeed checkpointing options our activation checkpointing does not implement |
| --fp16-lm-cross-entropy | the loss is always computed in fp32 |
| --no-save-optim | the DeepSpeed engine always saves the optimizer (Megatron-DeepSpeed's flag worked only without DeepSpeed) |
| --accumulate-allreduce-grads-in-fp32, --DDP-impl, --use-contiguous-buffers-in-ddp | Megatron's own DDP, unused: DeepSpeed does data parallelism |
| --num-layers-per-virtual-pipeline-stage, --no-scatter-gather-tensors-in-pipeline | Megatron's own pipeline schedule, unused: DeepSpeed's pipeline engine runs 1F1B |
| --adlr-autoresume, --adlr-autoresume-interval | NVIDIA's ADLR cluster autoresume |
| --deepspeed_mpi | MPI discovery; our launchers are deepspeed, torchrun, torch.distributed.launch and srun |
| BERT, T5/MLM, prefix-LM/MTF, ICT/biencoder/REALM and ViT flags | other model types; this trainer pretrains GPT |

Not refused here but checked after parsing: ``--lazy-mpu-init true`` (validation.py).
"""
from megatron.training.argument_foreign_flags import (FOREIGN_REFUSALS, OTHER_MODEL, OWN_DDP, OWN_PIPELINE,
                                                      add_foreign_accepted_flags)
from megatron.training.argument_types import ArgumentError, RejectedFlag

_LONG_RUN = "is not available yet (it comes with the long-run work); remove the flag"
_NO_OP_IN_MEGATRON_DEEPSPEED = "had no effect in Megatron-DeepSpeed; remove the flag"
_CHECKPOINTING = ("is a DeepSpeed activation-checkpointing option that our activation checkpointing "
                  "(RNG-replaying, optionally partitioned with --partition-activations) does not "
                  "implement; remove the flag")


def _zero_block(key):
    return f"had no effect in Megatron-DeepSpeed: set zero_optimization.{key} in the ds_config instead"


_SPECIFIC_REASONS = {
    "--reset-progress": f"resetting the progress counters on load {_LONG_RUN}",
    "--inference": ("builds a model without optimizer for the text-generation tools; pretraining "
                    "always trains; remove the flag"),
    "--batch-size": "--batch-size argument is no longer valid, use --micro-batch-size instead",
    "--warmup": "--warmup argument is no longer valid, use --lr-warmup-fraction instead",
    "--model-parallel-size": ("--model-parallel-size is no longer valid, use "
                              "--tensor-model-parallel-size instead"),
    "--zero-reduce-scatter": _zero_block("reduce_scatter"),
    "--zero-contigious-gradients": _zero_block("contiguous_gradients"),
    "--zero-reduce-bucket-size": _zero_block("reduce_bucket_size"),
    "--zero-allgather-bucket-size": _zero_block("allgather_bucket_size"),
    "--scattered-embeddings": _NO_OP_IN_MEGATRON_DEEPSPEED,
    "--memory-centric-tiled-linear": _NO_OP_IN_MEGATRON_DEEPSPEED,
    "--tile-factor": _NO_OP_IN_MEGATRON_DEEPSPEED,
    "--split-transformers": _NO_OP_IN_MEGATRON_DEEPSPEED,
    "--contigious-checkpointing": _CHECKPOINTING,
    "--checkpoint-in-cpu": _CHECKPOINTING,
    "--synchronize-each-layer": _CHECKPOINTING,
    "--profile-backward": _CHECKPOINTING,
    "--fp16-lm-cross-entropy": "the loss is always computed in fp32; remove the flag",
    "--no-save-optim": ("the DeepSpeed engine always saves the optimizer state (Megatron-DeepSpeed's flag "
                        "worked only without DeepSpeed); remove the flag"),
    "--accumulate-allreduce-grads-in-fp32": (
        "is an option of Megatron's own DDP, which is not used; with DeepSpeed set "
        "data_types.grad_accum_dtype in the ds_config (\"fp32\" by default with --bf16)"),
    "--DDP-impl": OWN_DDP,
    "--use-contiguous-buffers-in-ddp": OWN_DDP,
    "--num-layers-per-virtual-pipeline-stage": OWN_PIPELINE,
    "--no-scatter-gather-tensors-in-pipeline": OWN_PIPELINE,
    "--adlr-autoresume": ("NVIDIA's ADLR cluster autoresume is not supported; stop with "
                          "--exit-duration-in-mins or --kill-switch-path and resume with --load"),
    "--adlr-autoresume-interval": "NVIDIA's ADLR cluster autoresume is not supported; remove the flag",
    "--deepspeed_mpi": ("MPI discovery is not supported; launch with deepspeed, torchrun, "
                        "python -m torch.distributed.launch or srun"),
}

_MODEL_TYPE_FLAGS = {
    "BERT": ("--bert-no-binary-head", "--mask-prob", "--short-seq-prob", "--sample-rate"),
    "T5/MLM": ("--vocab-extra-ids", "--decoder-seq-length", "--noise-density", "--mean-noise-span-length"),
    "prefix-LM/MTF": ("--loss-on-targets-only", "--reweight-loss-based-on-position-frequency",
                      "--norm-target-loss"),
    "ICT/biencoder/REALM": (
        "--retriever-seq-length", "--ict-head-size", "--biencoder-projection-dim",
        "--biencoder-shared-query-context-model", "--ict-load", "--bert-load", "--titles-data-path",
        "--query-in-block-prob", "--use-one-sent-docs", "--evidence-data-path",
        "--retriever-report-topk-accuracies", "--retriever-score-scaling", "--block-data-path",
        "--embedding-path", "--indexer-batch-size", "--indexer-log-interval"),
    "ViT": ("--init-method-xavier-uniform", "--num-classes", "--img-dim", "--num-channels", "--patch-dim"),
}
REJECTED_FLAGS = {
    **_SPECIFIC_REASONS,
    **{flag: f"is a {model_type}-only flag; {OTHER_MODEL}"
       for model_type, flags in _MODEL_TYPE_FLAGS.items() for flag in flags},
    **FOREIGN_REFUSALS,
}


class _RefusedFlags(RejectedFlag):
    """Every refused flag in one action (registering each alone would slow every parser build): parsing
    ``--flag`` raises ArgumentError with ``reasons[--flag]``."""

    def __init__(self, option_strings, dest, reasons, **kwargs):
        super().__init__(option_strings, dest, reason=None, **kwargs)
        self.reasons = reasons

    def __call__(self, parser, namespace, values, option_string=None):
        raise ArgumentError(f"{option_string}: {self.reasons[option_string]}")


def add_rejected_flags(parser) -> None:
    """Register the accepted foreign spellings, then every flag of REJECTED_FLAGS so that giving it raises
    ArgumentError with its reason; a flag the parser already has is left to it."""
    add_foreign_accepted_flags(parser)
    group = parser.add_argument_group(
        "refused", "flags that are recognised and refused with a reason (hidden; the table is in "
                   "megatron/training/argument_rejections.py and argument_foreign_flags.py)")
    refused = [flag for flag in REJECTED_FLAGS if flag not in parser._option_string_actions]
    group.add_argument(*refused, dest="rejected_flag", action=_RefusedFlags, reasons=REJECTED_FLAGS)
