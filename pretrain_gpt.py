"""Pretrain a GPT model with Megatron-DeepSpeed's flags on the DeepSpeed engine.

    python pretrain_gpt.py ...                                 one process (CPU: gloo, world 1)
    deepspeed --num_gpus 8 pretrain_gpt.py ... --deepspeed --deepspeed_config ds_config.json
    torchrun --nproc_per_node 8 pretrain_gpt.py ...            (also torch.distributed.launch, srun)

Steps: choose DeepSpeed's accelerator (CPU without CUDA) before it is imported, parse and validate
the flags (megatron/training/arguments.py), build the tokenizer and the typed configuration, then
megatron.training.pretrain runs the job.
"""
import os
import sys

from megatron.training.initialize import select_accelerator

select_accelerator()

from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from megatron.core.tokenizer import TokenizerError, build_tokenizer  # noqa: E402
from megatron.training.arguments import (ArgumentError, format_args, parse_args_or_exit,  # noqa: E402
                                         write_args_listing)
from megatron.training.checkpointing import CheckpointError  # noqa: E402
from megatron.training.config import build_config  # noqa: E402
from megatron.training.data_loading import DataLoadingError  # noqa: E402
from megatron.training.initialize import FusedKernelConstraintError  # noqa: E402
from megatron.training.lr_schedule import LRScheduleError  # noqa: E402
from megatron.training.training import UnsupportedConfigurationError, pretrain  # noqa: E402

# Errors of the run's inputs (checkpoint, data, schedule), reported as one line rather than a traceback.
RUN_ERRORS = (CheckpointError, DataLoadingError, FusedKernelConstraintError, LRScheduleError,
              UnsupportedConfigurationError)


def _exit_with_error(error: Exception, status: int) -> None:
    print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr, flush=True)
    sys.exit(status)


@record
def main(argv=None):
    """Parse, configure, pretrain; bad flags exit with status 2, bad checkpoints/data with status 1.

    ``@record`` writes a rank's uncaught exception where torchrun reports it.
    """
    args = parse_args_or_exit(argv)
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file, merge_file=args.merge_file,
                                    tokenizer_name_or_path=args.tokenizer_name_or_path)
        config = build_config(args, tokenizer.vocab_size)
    except (ArgumentError, TokenizerError) as error:
        _exit_with_error(error, 2)
    if args.rank == 0:
        print(format_args(args), flush=True)
        if args.log_path:
            write_args_listing(args, args.log_path)
    try:
        pretrain(config, tokenizer, arguments=vars(args))
    except RUN_ERRORS as error:
        _exit_with_error(error, 1)


if __name__ == "__main__":
    main()
