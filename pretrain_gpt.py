"""Pretrain a GPT model with Megatron-DeepSpeed's flags on the DeepSpeed engine.

    python pretrain_gpt.py ...                                 one process (CPU: gloo, world 1)
    deepspeed --num_gpus 8 pretrain_gpt.py ... --deepspeed --deepspeed_config ds_config.json
    torchrun --nproc_per_node 8 pretrain_gpt.py ...            (also torch.distributed.launch, srun)

Steps: choose DeepSpeed's accelerator (CPU without CUDA) before it is imported; parse and validate
the flags (megatron/training/arguments.py); build the tokenizer and the typed configuration; open
every dataset once; check the checkpoint directories (a readable ``latest`` in --load, no
checkpoints in --save that a run from iteration 0 would replace); then megatron.training.pretrain
runs the job. Everything before pretrain runs
without a process group, so a bad flag, tokenizer or data path stops every rank at once; rank 0
reports it, the others wait for the launcher to stop them (report_error_and_exit). Later, an error of
one rank ends that rank (its message or traceback is the job's error); the others find it gone at
their next collective and stop with one line each, exit status 1.
"""
import os
import sys
import time

from megatron.training.initialize import select_accelerator

select_accelerator()

from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from megatron.core.data.indexed_dataset import IndexedDatasetError  # noqa: E402
from megatron.core.tokenizer import TokenizerError, build_tokenizer  # noqa: E402
from megatron.training.arguments import (ArgumentError, parse_args_or_exit, report_arguments,  # noqa: E402
                                         report_error_and_exit)
from megatron.training.checkpoint_checks import CheckpointError, check_checkpoint_directories  # noqa: E402
from megatron.training.config import build_config  # noqa: E402
from megatron.training.data_loading import DataLoadingError, check_dataset_files  # noqa: E402
from megatron.training.dist_utils import first_to_report, peer_lost, rank, world_size  # noqa: E402
from megatron.training.initialize import FusedKernelConstraintError  # noqa: E402
from megatron.training.lr_schedule import LRScheduleError  # noqa: E402
from megatron.training.signals import exit_without_finalization  # noqa: E402
from megatron.training.training import TrainingDivergedError, pretrain  # noqa: E402

# How long every rank stays after an error: rank 0 holds the store the others ask whether it is reported, and
# the first to report it must print before a launcher, seeing a rank end, stops the job.
STORE_LINGER_SECONDS = 2.0
# Errors of the run's inputs (checkpoint, data, schedule), reported as one line rather than a traceback.
RUN_ERRORS = (CheckpointError, DataLoadingError, FusedKernelConstraintError, IndexedDatasetError, LRScheduleError,
              TrainingDivergedError)


@record
def main(argv=None):
    """Parse, configure, check the data, pretrain; bad flags, tokenizer or data paths exit with
    status 2, bad checkpoints or data contents with status 1.

    ``@record`` writes a rank's uncaught exception where torchrun reports it.
    """
    parsed = parse_args_or_exit(argv)
    flags = parsed.flags
    try:
        tokenizer = build_tokenizer(flags.tokenizer_type, vocab_file=flags.vocab_file, merge_file=flags.merge_file,
                                    tokenizer_name_or_path=flags.tokenizer_name_or_path,
                                    tokenizer_model=flags.tokenizer_model)
        config = build_config(parsed, tokenizer.vocab_size)
        check_dataset_files(config.data.dataset)
    except (ArgumentError, TokenizerError) as error:
        report_error_and_exit(error, 2)
    try:
        check_checkpoint_directories(config.checkpoint)
    except CheckpointError as error:
        report_error_and_exit(error, 1)
    report_arguments(parsed)
    try:
        pretrain(config, tokenizer)
    except Exception as error:  # noqa: BLE001 - every error of the run is reported once for the whole job
        report_run_failure(error)


def report_run_failure(error: Exception):
    """Show each error of the run once for the whole job, then exit 1.

    A rank that finds another one gone mid-collective prints one line instead of gloo's traceback
    (the gone rank's own error, if it printed one, is the message that matters). An error several
    ranks meet alike is printed by the first of them only (dist_utils.first_to_report): a run error
    as one line, anything else as its traceback. The first prints before any rank exits: a launcher
    stops the whole job when one rank ends with an error, so every rank lingers a moment first (and
    rank 0 holds the rendezvous store the others' lookups need)."""
    program = os.path.basename(sys.argv[0])
    if peer_lost(error):
        print(f"{program}: rank {rank()} stops: another rank of the job has ended (its own message, if it printed "
              f"one, says why)", file=sys.stderr, flush=True)
        sys.exit(1)
    first = first_to_report(f"{type(error).__name__}: {error}")
    if first and isinstance(error, RUN_ERRORS):
        print(f"{program}: error: {error}", file=sys.stderr, flush=True)
    if world_size() > 1:
        time.sleep(STORE_LINGER_SECONDS)
    if first and not isinstance(error, RUN_ERRORS):
        raise error  # the traceback, also for torchrun's error record; the first to linger is the first to end
    sys.exit(1)


if __name__ == "__main__":
    main()
    exit_without_finalization(0)
