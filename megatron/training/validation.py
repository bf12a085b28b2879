"""Cross-flag validation and derivation, before any process group or CUDA initialisation.

``validate_args`` checks the parsed flags against each other, against the launcher's world size
and against the ds_config, and fills the derived values (world size, ranks, data-parallel size,
global batch size, ffn and kv sizes, params dtype, the final ds_config). Every error is an
ArgumentError naming the flags and the fix. Model and dataset rules live with their configs in
megatron/core (GPTModelConfig, GPTDatasetConfig, data_paths): they are applied here by building
those configs once, the model with a stand-in vocabulary (the real one needs the tokenizer).
"""
import importlib.util
import math
from types import SimpleNamespace

import torch

from megatron.core.parallel_state import validate_parallel_sizes
from megatron.core.tokenizer import REJECTED_TOKENIZER_TYPES
from megatron.training.argument_ds_config import resolve_ds_config
from megatron.training.argument_types import ArgumentError
from megatron.training.config import dataset_config_from_args, lr_lengths_in_samples, model_config_from_args
from megatron.training.launch_env import effective_backend
from megatron.training.lr_schedule import AnnealingLR

POSITIVE_INTS = ("num_layers", "hidden_size", "num_attention_heads", "micro_batch_size", "seq_length",
                 "ffn_hidden_size", "kv_channels", "max_position_embeddings", "make_vocab_size_divisible_by",
                 "pad_vocab_size_to", "global_batch_size", "train_iters", "train_samples", "train_tokens",
                 "log_interval", "exit_interval", "exit_duration_in_mins", "eval_interval", "save_interval",
                 "tensorboard_log_interval", "tensorboard_queue_size", "lr_decay_iters", "lr_decay_samples",
                 "lr_decay_tokens", "checkpoint_num_layers", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "hysteresis")
NON_NEGATIVE_NUMBERS = ("eval_iters", "num_workers", "valid_num_workers", "lr_warmup_iters",
                        "lr_warmup_samples", "lr_warmup_tokens", "seed", "zero_stage", "lr", "min_lr",
                        "weight_decay", "clip_grad", "sgd_momentum")
POSITIVE_FLOATS = ("adam_eps", "loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window")
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "micro_batch_size", "seq_length")


def flag(dest: str) -> str:
    """The flag spelling of an argparse dest: "train_iters" -> "--train-iters"."""
    return "--" + dest.replace("_", "-")


def _check_sequence_length(args):
    if args.seq_length is not None and args.encoder_seq_length is not None:
        raise ArgumentError("--seq-length and --encoder-seq-length are the same setting: give one")
    args.seq_length = args.seq_length if args.seq_length is not None else args.encoder_seq_length
    args.encoder_seq_length = args.seq_length


def _check_required(args):
    missing = [flag(dest) for dest in REQUIRED if getattr(args, dest) is None]
    if missing:
        raise ArgumentError(f"missing required flag(s): {', '.join(missing)}")
    if args.train_iters is not None and args.train_samples is not None:
        raise ArgumentError("--train-iters and --train-samples are exclusive: train by iterations or by "
                            "samples, not both")
    if args.train_iters is None and args.train_samples is None:
        raise ArgumentError("give --train-iters or --train-samples (--train-tokens only adds a token stop)")
    if args.lr is None and not args.eval_only:
        raise ArgumentError("--lr (the peak learning rate) is required")


def _check_ranges(args):
    for dest in POSITIVE_INTS:
        value = getattr(args, dest)
        if value is not None and value < 1:
            raise ArgumentError(f"{flag(dest)} must be a positive integer, got {value}")
    for dest in NON_NEGATIVE_NUMBERS:
        value = getattr(args, dest)
        if value is not None and value < 0:
            raise ArgumentError(f"{flag(dest)} must be >= 0, got {value}")
    for dest in POSITIVE_FLOATS:
        value = getattr(args, dest)
        if value is not None and value <= 0:
            raise ArgumentError(f"{flag(dest)} must be > 0, got {value}")
    for dest in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, dest) < 1:
            raise ArgumentError(f"{flag(dest)} must be in [0, 1), got {getattr(args, dest)}")
    if args.lazy_mpu_init:
        raise ArgumentError("--lazy-mpu-init true: deferring the model-parallel init to an external manager "
                            "is not supported; drop the flag (or give false)")
    if args.data_impl in ("lazy", "cached"):
        raise ArgumentError(f"--data-impl {args.data_impl}: the legacy lazy/cached formats are not supported; "
                            f"use mmap (or infer) data from tools/preprocess_data.py")


def _check_units(args):
    """Seed §2: iteration-based and sample-based training each forbid the other unit's flags."""
    if args.train_iters is not None:
        foreign = [("lr_decay_samples", args.lr_decay_samples is not None),
                   ("lr_warmup_samples", args.lr_warmup_samples != 0),
                   ("rampup_batch_size", args.rampup_batch_size is not None)]
        unit, own_warmup = "--train-iters (iteration-based)", "lr_warmup_iters"
    else:
        foreign = [("lr_decay_iters", args.lr_decay_iters is not None),
                   ("lr_warmup_iters", args.lr_warmup_iters != 0)]
        unit, own_warmup = "--train-samples (sample-based)", "lr_warmup_samples"
    for dest, given in foreign:
        if given:
            raise ArgumentError(f"{flag(dest)} cannot be used with {unit} training: use the flags of the "
                                f"same unit (iterations with --train-iters, samples with --train-samples)")
    fraction = args.lr_warmup_fraction
    if fraction is not None and getattr(args, own_warmup) != 0:
        raise ArgumentError(f"--lr-warmup-fraction and {flag(own_warmup)} both set the warmup: give one")
    if args.lr_warmup_tokens is not None and (fraction is not None or args.lr_warmup_iters or
                                              args.lr_warmup_samples):
        raise ArgumentError("--lr-warmup-tokens and --lr-warmup-fraction/--lr-warmup-iters/--lr-warmup-samples "
                            "all set the warmup: give one")
    if fraction is not None and not 0 <= fraction < 1:
        raise ArgumentError(f"--lr-warmup-fraction must be in [0, 1), got {fraction}")
    _check_warmup_shorter_than_decay(args)


def _check_warmup_shorter_than_decay(args):
    if args.train_iters is not None:
        pairs = [("lr_warmup_iters", args.lr_warmup_iters,
                  "lr_decay_iters" if args.lr_decay_iters else "train_iters", args.lr_decay_iters or args.train_iters)]
    else:
        pairs = [("lr_warmup_samples", args.lr_warmup_samples, "lr_decay_samples" if args.lr_decay_samples
                  else "train_samples", args.lr_decay_samples or args.train_samples)]
    if args.lr_warmup_tokens is not None and args.lr_decay_tokens is not None:
        pairs.append(("lr_warmup_tokens", args.lr_warmup_tokens, "lr_decay_tokens", args.lr_decay_tokens))
    for warmup_dest, warmup, decay_dest, decay in pairs:
        if warmup and warmup >= decay:
            raise ArgumentError(f"{flag(warmup_dest)} ({warmup}) must be shorter than {flag(decay_dest)} "
                                f"({decay}), the decay length")


def _check_learning_rate_and_saving(args):
    if args.lr is not None and args.min_lr > args.lr:
        raise ArgumentError(f"--min-lr ({args.min_lr}) must be <= --lr ({args.lr})")
    if args.save and args.save_interval is None:
        raise ArgumentError("--save needs --save-interval (iterations between checkpoints)")


def _check_batch(args, explicit):
    dp, micro, total = args.data_parallel_size, args.micro_batch_size, args.global_batch_size
    step = micro * dp
    named = f"--global-batch-size {total}" if "global_batch_size" in explicit else \
        f"the global batch size {total} (ds_config train_batch_size)"
    if total % step:
        raise ArgumentError(
            f"{named} is not divisible by --micro-batch-size {micro} x data-parallel size {dp} (world size "
            f"{args.world_size} / (TP {args.tensor_model_parallel_size} x PP "
            f"{args.pipeline_model_parallel_size})) = {step}: use a multiple of {step}")
    if args.rampup_batch_size is not None:
        _check_rampup(args.rampup_batch_size, total, step, micro, dp)


def _check_rampup(rampup, total, step, micro, dp):
    start, increment, ramp_samples = rampup
    if start < 1 or increment < 1 or ramp_samples < 0:
        raise ArgumentError(f"--rampup-batch-size {start} {increment} {ramp_samples}: START and INCREMENT must "
                            f"be positive and RAMP_SAMPLES >= 0")
    if start > total or (total - start) % increment:
        raise ArgumentError(f"--rampup-batch-size {start} {increment} {ramp_samples}: the ramp must reach "
                            f"--global-batch-size {total} from START in whole INCREMENTs (START <= {total}, "
                            f"{total} - START a multiple of INCREMENT)")
    sizes = range(start, total + 1, increment)
    bad = [size for size in sizes if size % step]
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        raise ArgumentError(f"--rampup-batch-size {start} {increment} {ramp_samples}: every global batch of "
                            f"the ramp must be divisible by --micro-batch-size {micro} x data-parallel size "
                            f"{dp} = {step}; these are not: {shown}. Use START and INCREMENT multiples of {step}")


def _check_lr_schedule(args):
    """The schedule's own rules (lr_schedule.AnnealingLR), applied to a stand-in optimizer."""
    if args.lr is None:
        return
    warmup, decay = lr_lengths_in_samples(args)
    try:
        AnnealingLR(SimpleNamespace(param_groups=[{}]), args.lr, args.min_lr, warmup, decay, args.lr_decay_style,
                    warmup_tokens=args.lr_warmup_tokens, decay_tokens=args.lr_decay_tokens)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None


def _check_model(args):
    if (args.partition_activations or args.distribute_checkpointed_activations) and not args.checkpoint_activations:
        raise ArgumentError("--partition-activations / --distribute-checkpointed-activations need "
                            "--checkpoint-activations")
    tp, pad_to, multiple = args.tensor_model_parallel_size, args.pad_vocab_size_to, args.make_vocab_size_divisible_by
    if pad_to is not None and (pad_to % multiple or pad_to % tp):
        raise ArgumentError(f"--pad-vocab-size-to {pad_to} must be divisible by --make-vocab-size-divisible-by "
                            f"{multiple} and by --tensor-model-parallel-size {tp}: use a multiple of "
                            f"{math.lcm(multiple, tp)}")
    stand_in_vocab = args.pad_vocab_size_to or args.make_vocab_size_divisible_by * tp
    try:
        model = model_config_from_args(args, stand_in_vocab)
        model.validate_for_tensor_parallel(tp)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None
    args.ffn_hidden_size, args.kv_channels = model.ffn_hidden_size, model.kv_channels


def _check_data(args):
    weighted = [f"--{split}-weighted-split-paths{suffix}" for split in ("train", "valid", "test")
                for suffix in ("", "-path") if getattr(args, f"{split}_weighted_split_paths{suffix.replace('-', '_')}")]
    if args.data_path and weighted:
        raise ArgumentError(f"--data-path and {', '.join(weighted)} are exclusive: give --data-path (with "
                            f"--split) or the weighted split paths")
    if args.split is not None and weighted:
        raise ArgumentError("--split applies to --data-path only: the weighted split paths carry their own ranges")
    for split in ("train", "valid", "test"):
        if getattr(args, f"{split}_weighted_split_paths") and getattr(args, f"{split}_weighted_split_paths_path"):
            raise ArgumentError(f"--{split}-weighted-split-paths and --{split}-weighted-split-paths-path are "
                                f"exclusive: give one")
    if weighted and not (args.train_weighted_split_paths or args.train_weighted_split_paths_path):
        raise ArgumentError(f"{', '.join(weighted)} need --train-weighted-split-paths (or its -path form)")
    if not args.data_path and not weighted:
        raise ArgumentError("no training data: give --data-path PREFIX (or W1 PREFIX1 W2 PREFIX2 ...) or "
                            "--train-weighted-split-paths / --train-weighted-split-paths-path")
    try:
        dataset_config_from_args(args)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None


def _check_tokenizer_and_tools(args):
    kind = args.tokenizer_type
    if kind in REJECTED_TOKENIZER_TYPES:
        raise ArgumentError(f"--tokenizer-type {kind} is not supported (BERT tokenizers are out of scope); "
                            f"use GPT2BPETokenizer or PretrainedFromHF")
    if kind == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        raise ArgumentError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if kind == "PretrainedFromHF" and not args.tokenizer_name_or_path:
        raise ArgumentError("--tokenizer-type PretrainedFromHF needs --tokenizer-name-or-path")
    if args.codecarbon_dir and importlib.util.find_spec("codecarbon") is None:
        raise ArgumentError("--codecarbon-dir needs the codecarbon package: pip install codecarbon")
    if args.pp_partition_method is not None:
        from megatron.core.models.gpt.pipeline import check_partition_method
        try:
            check_partition_method(args.pp_partition_method)
        except ValueError as exc:
            raise ArgumentError(str(exc)) from None


def _derive_layout(args, launch, cuda_available):
    args.world_size, args.rank, args.local_rank = launch.world_size, launch.rank, launch.local_rank
    args.master_addr, args.master_port, args.launcher = launch.master_addr, launch.master_port, launch.source
    try:
        args.data_parallel_size = validate_parallel_sizes(
            launch.world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None
    args.distributed_backend, notice = effective_backend(args.distributed_backend, cuda_available)
    return [notice] if notice else []


def validate_args(args, explicit: set, launch, cuda_available: bool) -> list[str]:
    """Check the parsed flags, fill the derived values on ``args``; return the notices to print.

    ``explicit``: dests given on the command line; ``launch``: launch_env.LaunchEnv of this process.
    """
    _check_sequence_length(args)
    _check_required(args)
    _check_ranges(args)
    _check_units(args)
    _check_learning_rate_and_saving(args)
    notices = _derive_layout(args, launch, cuda_available)
    args.deepspeed_config_dict, ds_notices = resolve_ds_config(
        args, explicit, args.data_parallel_size, args.pipeline_model_parallel_size, cuda_available)
    notices += ds_notices
    args.params_dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32
    _check_batch(args, explicit)
    _check_lr_schedule(args)
    _check_model(args)
    _check_data(args)
    _check_tokenizer_and_tools(args)
    return notices
