"""Cross-flag validation and derivation, before any process group or CUDA initialisation.

``validate_args`` checks the parsed flags against each other, against the launcher's world size
and against the ds_config, and returns what they imply as a frozen ``DerivedValues`` (the launch
layout, the data-parallel size, the backend, the sequence length, the final ds_config, which
decides the global batch, precision, clipping and ZeRO stage, the learning-rate lengths in samples
and the curriculum), each computed here once. The parsed Namespace is only read.
Every error is an ArgumentError naming the flags and the fix. The model and dataset rules live
with their configs in megatron/core (GPTModelConfig, GPTDatasetConfig, data_paths) and run when
config.build_config builds those configs, once, with the tokenizer's vocabulary.
"""
import argparse
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from megatron.core.parallel_state import validate_parallel_sizes
from megatron.core.tokenizer import REJECTED_TOKENIZER_TYPES, SENTENCEPIECE_TYPES, SUPPORTED_TOKENIZER_TYPES
from megatron.training.engine.ds_config import resolve_ds_config
from megatron.training.argument_types import ArgumentError
from megatron.training.bnb_optimizer import INSTALL_HINT
from megatron.training.curriculum import CurriculumConfig, CurriculumConfigError, curriculum_config
from megatron.training.fp8_flags import check_fp8
from megatron.training.launch_env import LaunchEnv, effective_backend
from megatron.training.microbatches import BatchSizeError, check_batch_sizes
from megatron.training.lr_schedule import AnnealingLR

POSITIVE_INTS = ("num_layers", "hidden_size", "num_attention_heads", "micro_batch_size", "seq_length",
                 "ffn_hidden_size", "kv_channels", "max_position_embeddings", "make_vocab_size_divisible_by",
                 "pad_vocab_size_to", "global_batch_size", "train_iters", "train_samples", "train_tokens",
                 "log_interval", "exit_interval", "exit_duration_in_mins", "eval_interval", "save_interval",
                 "tensorboard_log_interval", "tensorboard_queue_size", "lr_decay_iters", "lr_decay_samples",
                 "lr_decay_tokens", "checkpoint_num_layers", "tensor_model_parallel_size", "keep_last_checkpoints",
                 "pipeline_model_parallel_size", "hysteresis")
NON_NEGATIVE_NUMBERS = ("eval_iters", "num_workers", "valid_num_workers", "lr_warmup_iters", "max_consecutive_nan_iterations",
                        "lr_warmup_samples", "lr_warmup_tokens", "seed", "zero_stage", "lr", "min_lr",
                        "weight_decay", "clip_grad", "sgd_momentum")
POSITIVE_FLOATS = ("adam_eps", "loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window")
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "micro_batch_size")
# The flags naming a directory the run writes into (created when missing).
OUTPUT_DIRECTORIES = ("save", "tensorboard_dir", "log_path", "data_cache_path", "codecarbon_dir", "wandb_save_dir")


@dataclass(frozen=True)
class DerivedValues:
    """What the flags imply once checked against each other, the launcher and the ds_config.

    Attributes:
        launch: this process's place in the job: rank, world size, local rank, rendezvous, launcher.
        data_parallel_size: DP = world size / (TP x PP).
        distributed_backend: the backend used: --distributed-backend, or gloo without CUDA.
        seq_length: --seq-length, or its alias --encoder-seq-length.
        ds_config: the final ds_config (argument_ds_config.py); the properties below read it, so the
            trainer and the DeepSpeed engine cannot disagree.
        notices: one-line notices printed once on rank 0 (flags the ds_config overrides, ...).
        lr_warmup_samples: the warmup length in samples (``lr_lengths_in_samples``; a float when
            --lr-warmup-fraction gives it).
        lr_decay_samples: the decay length in samples.
        curriculum: the ds_config's sequence-length curriculum (curriculum.py), or None.
    """

    launch: LaunchEnv
    data_parallel_size: int
    distributed_backend: str
    seq_length: int
    ds_config: dict
    notices: tuple[str, ...]
    lr_warmup_samples: int | float
    lr_decay_samples: int
    curriculum: CurriculumConfig | None

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step after the rampup: the ds_config's train_batch_size."""
        return self.ds_config["train_batch_size"]

    @property
    def fp16(self) -> bool:
        return self.ds_config["fp16"]["enabled"]

    @property
    def bf16(self) -> bool:
        return self.ds_config["bf16"]["enabled"]

    @property
    def params_dtype(self) -> torch.dtype:
        return torch.float16 if self.fp16 else torch.bfloat16 if self.bf16 else torch.float32

    @property
    def clip_grad(self) -> float:
        """Global L2 gradient clipping DeepSpeed applies: the ds_config's gradient_clipping."""
        return float(self.ds_config["gradient_clipping"])

    @property
    def zero_stage(self) -> int:
        return self.ds_config["zero_optimization"]["stage"]


def flag(dest: str) -> str:
    """The flag spelling of an argparse dest: "train_iters" -> "--train-iters"."""
    return "--" + dest.replace("_", "-")


def sequence_length(args) -> int | None:
    """--seq-length, or --encoder-seq-length (the same setting under Megatron's encoder name)."""
    if args.seq_length is not None and args.encoder_seq_length is not None:
        raise ArgumentError("--seq-length and --encoder-seq-length are the same setting: give one")
    return args.seq_length if args.seq_length is not None else args.encoder_seq_length


def _check_required(args, seq_length):
    missing = [flag(dest) for dest in REQUIRED if getattr(args, dest) is None]
    if seq_length is None:
        missing.append("--seq-length")
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
    """Iteration-based and sample-based training each forbid the other unit's flags."""
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
    if args.override_lr_scheduler and args.use_checkpoint_lr_scheduler:
        raise ArgumentError("--override-lr-scheduler and --use-checkpoint-lr-scheduler are exclusive: keep the "
                            "flags' schedule or take the checkpoint's, not both")
    if args.lr is not None and args.min_lr > args.lr:
        raise ArgumentError(f"--min-lr ({args.min_lr}) must be <= --lr ({args.lr})")
    if (args.keep_last_checkpoints or args.pin_checkpoints or args.save_interval_ranges) and not args.save:
        raise ArgumentError("--keep-last-checkpoints, --pin-checkpoints and --save-interval-ranges need --save")
    if args.save and args.save_interval is None:
        raise ArgumentError("--save needs --save-interval (iterations between checkpoints)")


def _check_batch(args, explicit, global_batch_size: int, data_parallel_size: int, world_size: int):
    """microbatches.check_batch_sizes, the one home of the batch-size rules, with where d comes from."""
    try:
        check_batch_sizes(global_batch_size, args.micro_batch_size, data_parallel_size, args.rampup_batch_size)
    except BatchSizeError as exc:
        source = "" if "global_batch_size" in explicit else \
            f"; the global batch size {global_batch_size} is the ds_config's train_batch_size"
        ulysses = f" x S {args.ds_sequence_parallel_size}" if args.ds_sequence_parallel_size > 1 else ""
        raise ArgumentError(f"{exc} (data-parallel size {data_parallel_size} = world size "
                            f"{world_size} / (TP {args.tensor_model_parallel_size} x PP "
                            f"{args.pipeline_model_parallel_size}{ulysses}){source})") from None


def _check_ulysses(args, derived: DerivedValues):
    """What DeepSpeed-Ulysses (--ds-sequence-parallel-size S > 1) runs with; the model's splits (heads,
    groups, sequence) are GPTModelConfig.validate_for_ulysses'."""
    size = args.ds_sequence_parallel_size
    if size == 1:
        return
    flag = f"--ds-sequence-parallel-size {size}"
    unsupported = (
        (bool(args.reset_attention_mask), "--reset-attention-mask"),
        (derived.curriculum is not None, "a sequence-length curriculum (curriculum_learning)"),
    )
    for refused, what in unsupported:
        if refused:
            raise ArgumentError(f"{flag} with {what} is not supported: run Ulysses with whole-sequence "
                                f"causal masks and a fixed --seq-length")


def lr_lengths_in_samples(args, global_batch_size: int) -> tuple[int | float, int]:
    """(warmup, decay) in samples, Megatron-DeepSpeed's AnnealingLR steps: iteration flags times the
    global batch, sample flags as given; --lr-warmup-fraction is a fraction of the decay (a float)."""
    if args.train_iters is not None:
        decay = (args.lr_decay_iters or args.train_iters) * global_batch_size
        warmup = args.lr_warmup_iters * global_batch_size
    else:
        decay = args.lr_decay_samples or args.train_samples
        warmup = args.lr_warmup_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return warmup, decay


def _check_lr_schedule(args, warmup: int | float, decay: int):
    """The schedule's own rules (lr_schedule.AnnealingLR) for these lengths in samples, applied to a
    stand-in optimizer."""
    if args.lr is None:
        return
    try:
        AnnealingLR(SimpleNamespace(param_groups=[{}]), args.lr, args.min_lr, warmup, decay, args.lr_decay_style,
                    warmup_tokens=args.lr_warmup_tokens, decay_tokens=args.lr_decay_tokens)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None


def _checked_curriculum(args, ds_config: dict, seq_length: int) -> CurriculumConfig | None:
    """The ds_config's curriculum_learning block (curriculum.py), and the token-based LR decay it needs:
    a decay in samples would run on while the early, short batches hold few tokens. Returns the block."""
    where = args.deepspeed_config or args.deepscale_config
    try:
        curriculum = curriculum_config(ds_config, where, seq_length)
    except CurriculumConfigError as exc:
        raise ArgumentError(str(exc)) from None
    if curriculum is not None and args.lr_decay_style != "constant" and args.lr_decay_tokens is None:
        raise ArgumentError(f"curriculum_learning in {where} needs a token-based learning-rate decay: give "
                            f"--lr-decay-tokens (Megatron-DeepSpeed's recipe: the decay samples x --seq-length "
                            f"{seq_length}), or --lr-decay-style constant")
    return curriculum


def _check_run_length(args, derived: DerivedValues):
    """A run must do what its flags ask: --eval-only and --finetune read --load, and the training
    length holds at least the first global batch (its samples, and its tokens: the rampup's first
    batch size times the curriculum's first sequence length)."""
    for dest, instead in (("eval_only", "the model's random initial weights would be evaluated"),
                          ("finetune", "the model would train from scratch")):
        if getattr(args, dest) and not args.load:
            raise ArgumentError(f"{flag(dest)} starts from the checkpoint in --load, and no --load is given "
                                f"({instead}): give --load DIR")
    if args.eval_only:
        return
    batch = args.rampup_batch_size[0] if args.rampup_batch_size else derived.global_batch_size
    if args.train_samples is not None and args.train_samples < batch:
        raise ArgumentError(f"--train-samples {args.train_samples} is less than one global batch ({batch} "
                            f"samples): nothing would be trained; give at least {batch}")
    curriculum = derived.curriculum
    seq_length = curriculum.min_difficulty if curriculum is not None else derived.seq_length
    if args.train_tokens is not None and args.train_tokens < batch * seq_length:
        raise ArgumentError(f"--train-tokens {args.train_tokens} is less than one global batch ({batch} samples "
                            f"x {seq_length} tokens = {batch * seq_length}): training would stop after the "
                            f"first iteration; give at least {batch * seq_length}")


def wandb_directory(args) -> str | None:
    """Where the W&B run files go: --wandb-save-dir, else the wandb/ directory in --save (Megatron-LM's
    default); None without --wandb-project."""
    if not args.wandb_project:
        return None
    if args.wandb_save_dir:
        return args.wandb_save_dir
    return os.path.join(args.save, "wandb") if args.save else None


def _check_wandb(args, explicit):
    """--wandb-project: the wandb package and a directory for the run files; the other W&B flags need it."""
    if not args.wandb_project:
        given = sorted(flag(dest) for dest in ("wandb_exp_name", "wandb_save_dir") if dest in explicit)
        if given:
            verb = "takes" if len(given) == 1 else "take"
            raise ArgumentError(f"{', '.join(given)} {verb} effect only with --wandb-project: add it, or drop "
                                f"{'it' if len(given) == 1 else 'them'}")
        return
    if importlib.util.find_spec("wandb") is None:
        raise ArgumentError("--wandb-project needs the wandb package, which is not installed: pip install wandb "
                            "(or this package's 'wandb' extra)")
    if wandb_directory(args) is None:
        raise ArgumentError("--wandb-project needs a directory for the run files: give --wandb-save-dir, or "
                            "--save (its wandb/ directory is used)")


def unwritable_reason(path: str) -> str | None:
    """Why the run could not create or write the directory ``path``, or None when it can. Leaves nothing
    on disk: the probe is an unnamed temporary file in the deepest directory that exists."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a directory"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        return f"cannot write in {existing}: {exc.strerror}"
    return None


def _check_output_directories(args):
    """Each output directory can be created and written now, rather than failing at the first save or
    after the process group started."""
    for dest in OUTPUT_DIRECTORIES:
        path = getattr(args, dest)
        reason = path and unwritable_reason(path)
        if reason:
            raise ArgumentError(f"{flag(dest)} {path}: {reason}; choose a directory this job can write")


def _check_bnb_optimizer(args, derived: DerivedValues):
    """--use-bnb-optimizer: Adam, ZeRO stage 0 or 1, no offload, and bitsandbytes installed (whether it
    runs on this machine is tried when the optimizer is built: bnb_optimizer.check_runs_on)."""
    if not args.use_bnb_optimizer:
        return
    stage = derived.zero_stage
    if args.optimizer != "adam":
        raise ArgumentError(f"--use-bnb-optimizer is 8-bit Adam: it needs --optimizer adam, not {args.optimizer}")
    if stage > 1:
        raise ArgumentError(f"--use-bnb-optimizer runs at ZeRO stage 0 or 1 (the stages the 104B runs used), "
                            f"not {stage}: set --zero-stage / zero_optimization.stage to 0 or 1")
    if (derived.ds_config["zero_optimization"].get("offload_optimizer") or {}).get("device", "none") != "none":
        raise ArgumentError("--use-bnb-optimizer and zero_optimization.offload_optimizer exclude each other: the "
                            "offloaded step is DeepSpeed's CPU Adam; drop one")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ArgumentError(f"--use-bnb-optimizer needs bitsandbytes, which is not installed: {INSTALL_HINT}")


def _check_profile(args, explicit, world_size: int):
    """--profile: torch.profiler only (Megatron-LM's default, nsys ranges through cudaProfilerStart, is not
    built), a window of at least one iteration, ranks of this job, and a directory for the files."""
    if not args.profile:
        given = sorted(flag(dest) for dest in ("use_pytorch_profiler", "profile_step_start", "profile_step_end",
                                               "profile_ranks") if dest in explicit)
        if given:
            raise ArgumentError(f"{', '.join(given)} take effect only with --profile: add it, or drop them")
        return
    if not args.use_pytorch_profiler:
        raise ArgumentError("--profile records with torch.profiler here: add --use-pytorch-profiler (Megatron-LM's "
                            "nsys ranges through cudaProfilerStart are not built)")
    if not 0 <= args.profile_step_start < args.profile_step_end:
        raise ArgumentError(f"--profile-step-start ({args.profile_step_start}) must be at least 0 and below "
                            f"--profile-step-end ({args.profile_step_end}): iterations start + 1 .. end are profiled")
    outside = [rank for rank in args.profile_ranks if not 0 <= rank < world_size]
    if outside:
        raise ArgumentError(f"--profile-ranks {' '.join(map(str, outside))}: this job has ranks 0-{world_size - 1}")
    if not args.tensorboard_dir:
        raise ArgumentError("--use-pytorch-profiler writes its trace and table into --tensorboard-dir: give one")


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


def _check_tokenizer_and_tools(args):
    kind = args.tokenizer_type
    if kind in REJECTED_TOKENIZER_TYPES:
        raise ArgumentError(f"--tokenizer-type {kind} is not supported (BERT tokenizers are out of scope); "
                            f"use one of {', '.join(SUPPORTED_TOKENIZER_TYPES)}")
    if kind == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        raise ArgumentError("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if kind == "PretrainedFromHF" and not args.tokenizer_name_or_path:
        raise ArgumentError("--tokenizer-type PretrainedFromHF needs --tokenizer-name-or-path")
    if kind == "HuggingFaceTokenizer" and not (args.tokenizer_model or args.tokenizer_name_or_path):
        raise ArgumentError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json, "
                            "or a directory holding one)")
    if kind in SENTENCEPIECE_TYPES:
        if not args.tokenizer_model:
            raise ArgumentError(f"--tokenizer-type {kind} needs --tokenizer-model (a SentencePiece .model file)")
        if importlib.util.find_spec("sentencepiece") is None:
            raise ArgumentError(f"--tokenizer-type {kind} needs the sentencepiece package: "
                                "pip install .[sentencepiece] (or pip install sentencepiece)")
    if args.codecarbon_dir and importlib.util.find_spec("codecarbon") is None:
        raise ArgumentError("--codecarbon-dir needs the codecarbon package: pip install codecarbon")
    if args.pp_partition_method is not None:
        from megatron.training.engine.pipeline_module import check_partition_method
        try:
            check_partition_method(args.pp_partition_method)
        except ValueError as exc:
            raise ArgumentError(str(exc)) from None


def _parallel_layout(args, explicit, launch: LaunchEnv, cuda_available: bool) -> tuple[int, str, list[str]]:
    """(data-parallel size, backend, notices) of this launch."""
    try:
        data_parallel_size = validate_parallel_sizes(
            launch.world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.ds_sequence_parallel_size)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None
    backend, notice = effective_backend(args.distributed_backend, cuda_available,
                                        explicit="distributed_backend" in explicit)
    return data_parallel_size, backend, [notice] if notice else []


def validate_args(args: argparse.Namespace, explicit: set[str], launch: LaunchEnv,
                  cuda_available: bool) -> DerivedValues:
    """Check the parsed flags (only read) and return what they imply; see the module docstring.

    ``explicit``: dests given on the command line; ``launch``: launch_env.LaunchEnv of this process.
    """
    seq_length = sequence_length(args)
    _check_required(args, seq_length)
    _check_ranges(args)
    _check_units(args)
    _check_learning_rate_and_saving(args)
    data_parallel_size, backend, notices = _parallel_layout(args, explicit, launch, cuda_available)
    data_shards = data_parallel_size // args.ds_sequence_parallel_size  # Ulysses ranks share their samples
    ds_config, ds_notices = resolve_ds_config(args, explicit, data_shards,
                                              args.pipeline_model_parallel_size, cuda_available)
    global_batch_size = ds_config["train_batch_size"]
    _check_batch(args, explicit, global_batch_size, data_shards, launch.world_size)
    warmup, decay = lr_lengths_in_samples(args, global_batch_size)
    _check_lr_schedule(args, warmup, decay)
    derived = DerivedValues(launch=launch, data_parallel_size=data_parallel_size, distributed_backend=backend,
                            seq_length=seq_length, ds_config=ds_config, notices=tuple(notices + ds_notices),
                            lr_warmup_samples=warmup, lr_decay_samples=decay,
                            curriculum=_checked_curriculum(args, ds_config, seq_length))
    _check_run_length(args, derived)
    _check_ulysses(args, derived)
    _check_bnb_optimizer(args, derived)
    check_fp8(args, explicit, cuda_available, derived.fp16)
    _check_profile(args, explicit, launch.world_size)
    _check_data(args)
    _check_tokenizer_and_tools(args)
    _check_wandb(args, explicit)
    _check_output_directories(args)
    return derived
