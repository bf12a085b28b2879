"""TrainConfig: the parsed and validated flags as frozen dataclasses, derived once.

    parsed = parse_args()                                 # megatron/training/arguments.py
    tokenizer = build_tokenizer(parsed.flags.tokenizer_type, ...)
    config = build_config(parsed, tokenizer.vocab_size)   # everything below receives typed config

``build_config`` builds each part once: the model config (the vocabulary padded by
megatron.core.tokenizer.vocab_size_with_padding: to --pad-vocab-size-to, else to a multiple of
--make-vocab-size-divisible-by x TP; GPTModelConfig's own rules, and the one check that heads,
ffn and vocabulary split over TP) and the dataset config (the weighted split path files are read
here). Their errors become ArgumentErrors naming the flags, still before any process group.
Values that the ds_config decides (batch sizes, precision, ZeRO stage, gradient clipping, loss
scaling) are read from the final ds_config, so config and engine cannot disagree. Learning-rate
lengths in samples (Megatron-DeepSpeed's AnnealingLR "steps") and the curriculum are validation's
DerivedValues.
"""
import copy
import dataclasses
from dataclasses import dataclass

import torch

from megatron.core.checkpoint.client_state import plain_value
from megatron.core.data.data_paths import (DEFAULT_SPLIT, parse_data_path, parse_split,
                                           parse_weighted_split_paths, read_weighted_split_paths_file)
from megatron.core.data.gpt_dataset import GPTDatasetConfig
from megatron.core.dtypes import canonical_dtype_name, dtype_name
from megatron.core.models.gpt.config import GPTModelConfig
from megatron.core.tokenizer import vocab_size_with_padding
from megatron.training.argument_types import ArgumentError, parse_interval_ranges, parse_iteration_ranges
from megatron.training.arguments import ParsedArguments
from megatron.training.curriculum import BLOCK as CURRICULUM_BLOCK
from megatron.training.curriculum import CurriculumConfig
from megatron.training.fp8_flags import fp8_settings
from megatron.training.recompute_flags import recompute_settings
from megatron.training.validation import DerivedValues, wandb_directory

DEFAULT_PP_PARTITION_METHOD = "type:transformer"


@dataclass(frozen=True)
class ProcessLayout:
    """Where this process sits in the job: what starting the process group needs (training and inference).

    Attributes:
        tensor_model_parallel_size: TP degree (--tensor-model-parallel-size).
        pipeline_model_parallel_size: PP degree (--pipeline-model-parallel-size).
        data_parallel_size: DP = world_size / (TP x PP).
        world_size: number of processes, from the launcher's environment.
        rank: this process's global rank.
        local_rank: rank on this node (selects the GPU).
        master_addr: rendezvous host.
        master_port: rendezvous port.
        launcher: what started the process (launch_env.LaunchEnv.source).
        distributed_backend: the backend used: --distributed-backend, or gloo without CUDA.
        deterministic: only deterministic kernels, for bitwise-reproducible GPU runs (--deterministic).
    """

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    world_size: int
    rank: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str
    distributed_backend: str
    deterministic: bool


@dataclass(frozen=True)
class ParallelConfig(ProcessLayout):
    """Layout of a training job: the ProcessLayout, and how training splits its work over it.

    Attributes:
        zero_stage: the ZeRO stage DeepSpeed runs (ds_config zero_optimization.stage).
        pp_partition_method: PipelineModule partition method (--pp-partition-method).
        sync_tp_duplicated_parameters: after every step, copy TP rank 0's values of the parameters
            every TP rank holds whole to the others and report any drift (--sync-tp-duplicated-parameters).
        sequence_parallel_size: S of DeepSpeed-Ulysses (--ds-sequence-parallel-size): S ranks of each DP
            line share their samples, each holding 1 / S of the positions; data_parallel_size (the
            ranks averaging gradients, ZeRO's partitions) counts them, ``data_shard_size`` does not.
    """

    zero_stage: int
    pp_partition_method: str
    sync_tp_duplicated_parameters: bool
    sequence_parallel_size: int = 1

    @property
    def data_shard_size(self) -> int:
        """The sample streams, data_parallel_size / S: what the global batch is divided by."""
        return self.data_parallel_size // self.sequence_parallel_size


@dataclass(frozen=True)
class TokenizerConfig:
    """The tokenizer (megatron.core.tokenizer.build_tokenizer's arguments).

    Attributes:
        tokenizer_type: --tokenizer-type.
        vocab_file: --vocab-file (GPT2BPETokenizer).
        merge_file: --merge-file (GPT2BPETokenizer).
        tokenizer_name_or_path: --tokenizer-name-or-path (PretrainedFromHF).
        tokenizer_model: --tokenizer-model (SentencePieceTokenizer, HuggingFaceTokenizer).
    """

    tokenizer_type: str
    vocab_file: str | None
    merge_file: str | None
    tokenizer_name_or_path: str | None
    tokenizer_model: str | None = None


@dataclass(frozen=True)
class InferenceConfig:
    """What running a checkpoint's model for inference needs (megatron/training/inference_model.py).

    Attributes:
        model: the checkpoint's model, configured for inference (no dropout, sdpa attention, no
            activation checkpointing nor sequence parallelism); its seq_length is ``seq_length``.
        parallel: this process's layout: TP and PP as given, else the checkpoint's.
        tokenizer: the tokenizer of the flags.
        load: the checkpoint directory (--load).
        seq_length: the longest sequence the model takes: --seq-length, else the checkpoint's.
        seed: --seed, of the sampling generator and the model-parallel RNG.
        micro_batch_size: --micro-batch-size, or None when not given.
    """

    model: GPTModelConfig
    parallel: ProcessLayout
    tokenizer: TokenizerConfig
    load: str
    seq_length: int
    seed: int
    micro_batch_size: int | None


@dataclass(frozen=True)
class DataConfig:
    """Datasets, tokenizer and data loading.

    Attributes:
        dataset: the train/valid/test dataset description (Option 1 --data-path/--split or Option 2
            weighted split groups); parse_args requires one, so None only when built from other args.
        tokenizer_type: --tokenizer-type.
        vocab_file: --vocab-file (GPT2BPETokenizer).
        merge_file: --merge-file (GPT2BPETokenizer).
        tokenizer_name_or_path: --tokenizer-name-or-path (PretrainedFromHF).
        tokenizer_model: --tokenizer-model (SentencePieceTokenizer, HuggingFaceTokenizer).
        orig_vocab_size: the tokenizer's vocabulary before padding (kept for conversion tools).
        dataloader_type: "single" (resumable, sequential) or "cyclic" (--dataloader-type).
        num_workers: training DataLoader workers (--num-workers).
        valid_num_workers: validation DataLoader workers (--valid-num-workers).
        eod_mask_loss: no loss on EOD tokens (--eod-mask-loss).
        reset_position_ids: position ids restart after each EOD (--reset-position-ids).
        reset_attention_mask: no attention across EOD (--reset-attention-mask).
    """

    dataset: GPTDatasetConfig | None
    tokenizer_type: str
    vocab_file: str | None
    merge_file: str | None
    tokenizer_name_or_path: str | None
    tokenizer_model: str | None
    orig_vocab_size: int
    dataloader_type: str
    num_workers: int
    valid_num_workers: int
    eod_mask_loss: bool
    reset_position_ids: bool
    reset_attention_mask: bool


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer hyper-parameters.

    Attributes:
        optimizer: "adam" (Adam with decoupled weight decay, as Megatron-DeepSpeed means it) or "sgd".
        lr: peak learning rate (--lr).
        min_lr: learning-rate floor (--min-lr).
        weight_decay: decoupled weight decay, not applied to biases and norm weights (--weight-decay).
        adam_beta1, adam_beta2, adam_eps: Adam's beta1, beta2 and epsilon.
        sgd_momentum: SGD momentum (--sgd-momentum).
        use_bnb_optimizer: Adam as bitsandbytes' AdamW8bit, the embedding's state in 32 bits (--use-bnb-optimizer).
        clip_grad: global L2 clipping DeepSpeed applies: ds_config gradient_clipping, else --clip-grad.
    """

    optimizer: str
    lr: float | None
    min_lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    sgd_momentum: float
    use_bnb_optimizer: bool
    clip_grad: float


@dataclass(frozen=True)
class ScheduleConfig:
    """Batch sizes, length of training, learning-rate schedule, evaluation and exit conditions.

    Attributes:
        micro_batch_size: samples per GPU per micro step.
        global_batch_size: samples per optimizer step after the rampup (ds_config train_batch_size).
        rampup_batch_size: (start, increment, ramp samples) of --rampup-batch-size, or None.
        train_iters: iterations to train (--train-iters), None for sample-based training.
        train_samples: samples to train (--train-samples), None for iteration-based training.
        train_tokens: also stop once this many tokens are consumed (--train-tokens), or None.
        lr_decay_style: "constant", "linear", "cosine" or "inverse-square-root".
        lr_warmup_steps: warmup length in samples (iterations x global batch, samples, or a fraction
            of the decay length; a float in the last case, as in Megatron-DeepSpeed).
        lr_decay_steps: decay length in samples.
        lr_warmup_tokens: warmup length in tokens (--lr-warmup-tokens), or None.
        lr_decay_tokens: decay length in tokens, replacing the sample decay (--lr-decay-tokens), or None.
        eval_interval: iterations between evaluations.
        eval_iters: iterations per evaluation; 0 disables validation and test.
        eval_only: skip training and only evaluate (--eval-only).
        log_interval: iterations between log lines.
        exit_interval: save and exit at multiples of this iteration, or None.
        exit_duration_in_mins: save and exit after this many minutes, or None.
        kill_switch_path: save and exit when this file exists, or None.
        lr_scheduler_source: on resume, "check" (the checkpoint's schedule settings must equal the
            flags), "override" (--override-lr-scheduler) or "checkpoint" (--use-checkpoint-lr-scheduler).
        skip_train_iteration_ranges: inclusive iteration ranges whose batches are drawn and discarded
            (--skip-train-iteration-range), sorted and merged.
        max_consecutive_nan_iterations: save and stop after this many NaN/Inf iterations in a row; 0 never.
        curriculum: the sequence-length curriculum (the ds_config's curriculum_learning block), or None.
    """

    micro_batch_size: int
    global_batch_size: int
    rampup_batch_size: tuple[int, int, int] | None
    train_iters: int | None
    train_samples: int | None
    train_tokens: int | None
    lr_decay_style: str
    lr_warmup_steps: int | float
    lr_decay_steps: int
    lr_warmup_tokens: int | None
    lr_decay_tokens: int | None
    eval_interval: int
    eval_iters: int
    eval_only: bool
    log_interval: int
    exit_interval: int | None
    exit_duration_in_mins: int | None
    kill_switch_path: str | None
    lr_scheduler_source: str
    skip_train_iteration_ranges: tuple[tuple[int, int], ...]
    max_consecutive_nan_iterations: int
    curriculum: CurriculumConfig | None = None


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving and resuming.

    Attributes:
        save: directory to save to, or None.
        load: directory to resume from, or None.
        save_interval: iterations between saves (required with save).
        no_load_optim: do not load the optimizer state (the LR schedule and counters still load).
        no_load_rng: do not load the RNG states.
        no_save_rng: do not save the RNG states.
        finetune: load the weights and restart at iteration 0.
        universal_checkpoint: --load is resumed from the universal checkpoint ``latest_universal`` names
            (--universal-checkpoint, or the ds_config's checkpoint.load_universal).
        overwrite_checkpoints: a run starting at iteration 0 may save into a --save that holds checkpoints.
        save_interval_ranges: (start, end, interval) of --save-interval-ranges: another interval within
            an inclusive iteration range; save_interval applies outside them.
        keep_last_checkpoints: keep only the last K checkpoints (--keep-last-checkpoints), or None to keep all.
        pinned_checkpoints: iterations whose checkpoints are never deleted (--pin-checkpoints).
        allow_missing_manifest: a checkpoint of this trainer without its manifest is loaded, unverified,
            with a warning (--allow-missing-manifest); without it such a checkpoint is refused.
    """

    save: str | None
    load: str | None
    save_interval: int | None
    no_load_optim: bool
    no_load_rng: bool
    no_save_rng: bool
    finetune: bool
    universal_checkpoint: bool
    overwrite_checkpoints: bool
    save_interval_ranges: tuple[tuple[int, int, int], ...]
    keep_last_checkpoints: int | None
    pinned_checkpoints: tuple[int, ...]
    allow_missing_manifest: bool = False

    def save_due(self, iteration: int) -> bool:
        """Whether ``iteration`` is a multiple of the save interval in force there."""
        if self.save is None:
            return False
        interval = next((every for start, end, every in self.save_interval_ranges if start <= iteration <= end),
                        self.save_interval)
        return iteration % interval == 0


@dataclass(frozen=True)
class LoggingConfig:
    """Logs, TensorBoard, Weights & Biases and emissions.

    Attributes:
        tensorboard_dir: TensorBoard output directory, or None.
        tensorboard_log_interval: iterations between TensorBoard scalars.
        tensorboard_queue_size: SummaryWriter max_queue.
        log_timers_to_tensorboard: write time/* and iteration-time/*.
        log_batch_size_to_tensorboard: write batch-size/*.
        log_learning_rate_to_tensorboard: write learning-rate/* (off with --no-log-learnig-rate-to-tensorboard).
        log_loss_scale_to_tensorboard: write loss-scale/*.
        log_validation_ppl_to_tensorboard: also write validation perplexity.
        log_params_norm: log the L2 norm of the parameters.
        log_num_zeros_in_grad: log the number of zero gradients.
        codecarbon_dir: codecarbon output directory (offline tracking), or None.
        log_level: log level of rank 0, or None for the default.
        log_level_replica: log level of the other ranks, or None.
        log_path: directory for the arguments listing (arguments.write_args_listing), or None.
        wandb_project: the W&B project the TensorBoard scalars also go to (--wandb-project), or None.
        wandb_exp_name: the W&B run's name (--wandb-exp-name), or None for W&B's own.
        wandb_save_dir: directory of the W&B run files: --wandb-save-dir, else the wandb/ directory in
            --save; None without wandb_project.
    """

    tensorboard_dir: str | None
    tensorboard_log_interval: int
    tensorboard_queue_size: int
    log_timers_to_tensorboard: bool
    log_batch_size_to_tensorboard: bool
    log_learning_rate_to_tensorboard: bool
    log_loss_scale_to_tensorboard: bool
    log_validation_ppl_to_tensorboard: bool
    log_params_norm: bool
    log_num_zeros_in_grad: bool
    codecarbon_dir: str | None
    log_level: str | None
    log_level_replica: str | None
    log_path: str | None
    wandb_project: str | None
    wandb_exp_name: str | None
    wandb_save_dir: str | None


@dataclass(frozen=True)
class ProfileConfig:
    """Megatron-LM's --profile flags (profiling.py; validation.py checks them).

    Attributes:
        enabled: --profile (with --use-pytorch-profiler).
        step_start: the iteration after which recording starts (--profile-step-start).
        step_end: the last iteration recorded (--profile-step-end).
        ranks: the global ranks that record (--profile-ranks).
        directory: where the trace and the table go (--tensorboard-dir).
    """

    enabled: bool
    step_start: int
    step_end: int
    ranks: tuple[int, ...]
    directory: str | None


@dataclass(frozen=True)
class PrecisionConfig:
    """Numeric precision as DeepSpeed runs it (from the final ds_config).

    Attributes:
        fp16: fp16 parameters with dynamic (or static) loss scaling.
        bf16: bf16 parameters.
        params_dtype: torch dtype of the parameters (float16, bfloat16 or float32).
        loss_scale: static loss scale, None when dynamic or without fp16.
        initial_loss_scale: first dynamic scale (2**fp16.initial_scale_power), None without fp16.
        min_loss_scale: floor of the dynamic scale, None without fp16.
        loss_scale_window: iterations without overflow before the scale doubles, None without fp16.
        hysteresis: overflows tolerated before the scale halves, None without fp16.
        grad_accum_dtype: dtype gradients accumulate in: "fp32", "bf16" or "fp16".
        gradient_accumulation_fusion: under bf16 with fp32 accumulation, the weight-gradient GEMMs of
            the linear layers add into the fp32 accumulators themselves (off: --no-gradient-accumulation-fusion).
    """

    fp16: bool
    bf16: bool
    params_dtype: torch.dtype
    loss_scale: float | None
    initial_loss_scale: float | None
    min_loss_scale: float | None
    loss_scale_window: float | None
    hysteresis: int | None
    grad_accum_dtype: str
    gradient_accumulation_fusion: bool


@dataclass(frozen=True)
class DeepSpeedSettings:
    """The DeepSpeed engine's configuration.

    Attributes:
        config_path: --deepspeed_config, or None when the config was built from the flags.
        config: the final ds_config (checked and completed by argument_ds_config.py).
    """

    config_path: str | None
    config: dict

    @property
    def offloads_optimizer(self) -> bool:
        """ZeRO keeps the optimizer states and step on the CPU (zero_optimization.offload_optimizer) and
        steps them with DeepSpeed's CPU Adam: unless zero_force_ds_cpu_optimizer is false
        (--cpu_torch_adam), where torch's AdamW runs there."""
        offload = self.config.get("zero_optimization", {}).get("offload_optimizer") or {}
        deepspeed_adam = self.config.get("zero_force_ds_cpu_optimizer") is not False
        return offload.get("device", "none") == "cpu" and deepspeed_adam

    def config_for_initialize(self) -> dict:
        """A private copy for ``deepspeed.initialize(config=...)``, which may modify what it gets; without
        the curriculum_learning block, which the trainer runs and DeepSpeed 0.19 refuses (curriculum.py)."""
        config = copy.deepcopy(self.config)
        config.pop(CURRICULUM_BLOCK, None)
        return config


@dataclass(frozen=True)
class TrainConfig:
    """Everything the trainer needs, derived once from the flags.

    Attributes:
        model: the GPT model (padded vocabulary included).
        parallel, data, optimizer, schedule, checkpoint, logging, profile, precision, deepspeed: see each class.
        abort_on_unmet_fused_kernel_constraints: fail instead of falling back to the reference path
            when a fused kernel cannot serve the configured shapes on GPU.
        notices: the one-line notices printed while parsing (flags overridden by the ds_config,
            gloo instead of nccl, fp32 gradient accumulation with bf16, ...).
    """

    model: GPTModelConfig
    parallel: ParallelConfig
    data: DataConfig
    optimizer: OptimizerConfig
    schedule: ScheduleConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    profile: ProfileConfig
    precision: PrecisionConfig
    deepspeed: DeepSpeedSettings
    abort_on_unmet_fused_kernel_constraints: bool
    notices: tuple[str, ...]


def model_config_from_args(flags, derived: DerivedValues, padded_vocab_size: int) -> GPTModelConfig:
    """GPTModelConfig from the flags: fields matched by name, then the derived and renamed ones;
    checked for the TP degree. Model rules raise ArgumentError naming the flags."""
    # torch's fused attention kernels accumulate their backward with atomics: --deterministic computes
    # attention through the materialized path (matmuls and our Triton softmax), the same function.
    renamed = {"padded_vocab_size": padded_vocab_size, "seq_length": derived.seq_length,
               "params_dtype": derived.params_dtype,
               "attention_impl": "materialized" if flags.deterministic else "sdpa",
               "embed_layernorm": bool(flags.embed_layernorm or flags.use_bnb_optimizer),
               "stable_embedding": bool(flags.use_bnb_optimizer),
               "distribute_checkpointed_activations": bool(flags.distribute_checkpointed_activations
                                                           or flags.partition_activations),
               "use_cpu_initialization": bool(flags.use_cpu_initialization),
               "sequence_parallel": bool(flags.sequence_parallel and flags.tensor_model_parallel_size > 1),
               "tp_comm_overlap": bool(flags.tp_comm_overlap and flags.tensor_model_parallel_size > 1)}
    renamed.update(_llama_settings(flags))
    renamed.update(recompute_settings(flags))
    renamed.update(fp8_settings(flags))
    values = {f.name: getattr(flags, f.name) for f in dataclasses.fields(GPTModelConfig)
              if f.name not in renamed and hasattr(flags, f.name)}
    try:
        model = GPTModelConfig(**values, **renamed)
        model.validate_for_tensor_parallel(flags.tensor_model_parallel_size)
        model.validate_for_ulysses(flags.tensor_model_parallel_size, flags.ds_sequence_parallel_size)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None
    return model


def _megatron_lm_swiglu_ffn(hidden_size: int) -> int:
    """Megatron-LM's --swiglu default of --ffn-hidden-size: 4h x 2/3 rounded down to a multiple of 64
    (two first-layer projections instead of one keep the MLP's parameter count near 8h^2)."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64


def _llama_settings(flags) -> dict:
    """The model fields that the Llama-class flags set under other names: the key/value groups
    (--group-query-attention --num-query-groups, or --num-key-value-heads), --swiglu (and its ffn
    default) and --use-rotary-position-embeddings."""
    settings = {}
    groups = flags.num_key_value_heads
    if groups is None and flags.group_query_attention:
        if flags.num_query_groups is None:
            raise ArgumentError("--group-query-attention needs --num-query-groups G (the key/value heads)")
        groups = flags.num_query_groups
    elif flags.num_query_groups is not None and not flags.group_query_attention:
        raise ArgumentError("--num-query-groups takes effect with --group-query-attention: add it")
    settings["num_query_groups"] = groups
    if flags.swiglu:
        if flags.glu_activation not in (None, "swiglu"):
            raise ArgumentError(f"--swiglu contradicts --glu-activation {flags.glu_activation}: keep one")
        settings.update(glu_activation="swiglu", bias_gelu_fusion=False)
        if flags.ffn_hidden_size is None and flags.hidden_size is not None:
            settings["ffn_hidden_size"] = _megatron_lm_swiglu_ffn(flags.hidden_size)
    if flags.use_rotary_position_embeddings:
        if flags.position_embedding_type not in ("absolute", "rotary"):
            raise ArgumentError(f"--use-rotary-position-embeddings contradicts --position-embedding-type "
                                f"{flags.position_embedding_type}: keep one")
        settings["position_embedding_type"] = "rotary"
    return settings


def _weighted_groups(flags, split):
    inline = getattr(flags, f"{split}_weighted_split_paths")
    path = getattr(flags, f"{split}_weighted_split_paths_path")
    if inline:
        return parse_weighted_split_paths(inline, f"--{split}-weighted-split-paths")
    if path:
        return read_weighted_split_paths_file(path, f"--{split}-weighted-split-paths-path")
    return ()


def dataset_config_from_args(flags, seq_length: int, vocab_size: int | None = None) -> GPTDatasetConfig | None:
    """GPTDatasetConfig from the data flags (files of the -path flags are read), None without data;
    ``vocab_size``: the tokenizer's, which the token ids are checked against.
    Malformed paths, weights or ranges raise ArgumentError naming the flag."""
    try:
        groups = {split: _weighted_groups(flags, split) for split in ("train", "valid", "test")}
        if not flags.data_path and not any(groups.values()):
            return None
        return GPTDatasetConfig(
            seq_length=seq_length, seed=flags.seed,
            data_path=parse_data_path(flags.data_path) if flags.data_path else (),
            split=parse_split(flags.split or DEFAULT_SPLIT),
            train_groups=groups["train"], valid_groups=groups["valid"], test_groups=groups["test"],
            data_impl=flags.data_impl, mmap_warmup=flags.mmap_warmup, data_cache_path=flags.data_cache_path,
            vocab_size=vocab_size)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None


def _schedule_config(flags, derived: DerivedValues) -> ScheduleConfig:
    return ScheduleConfig(
        micro_batch_size=flags.micro_batch_size, global_batch_size=derived.global_batch_size,
        rampup_batch_size=tuple(flags.rampup_batch_size) if flags.rampup_batch_size else None,
        train_iters=flags.train_iters, train_samples=flags.train_samples, train_tokens=flags.train_tokens,
        lr_decay_style=flags.lr_decay_style, lr_warmup_steps=derived.lr_warmup_samples,
        lr_decay_steps=derived.lr_decay_samples,
        lr_warmup_tokens=flags.lr_warmup_tokens, lr_decay_tokens=flags.lr_decay_tokens,
        eval_interval=flags.eval_interval, eval_iters=flags.eval_iters, eval_only=bool(flags.eval_only),
        log_interval=flags.log_interval, exit_interval=flags.exit_interval,
        exit_duration_in_mins=flags.exit_duration_in_mins, kill_switch_path=flags.kill_switch_path,
        lr_scheduler_source="override" if flags.override_lr_scheduler else
        "checkpoint" if flags.use_checkpoint_lr_scheduler else "check",
        skip_train_iteration_ranges=parse_iteration_ranges(flags.skip_train_iteration_range or (),
                                                           "--skip-train-iteration-range"),
        max_consecutive_nan_iterations=flags.max_consecutive_nan_iterations,
        curriculum=derived.curriculum)


def _precision_config(flags, derived: DerivedValues) -> PrecisionConfig:
    ds_config = derived.ds_config
    fp16 = ds_config["fp16"]
    accum = ds_config.get("data_types", {}).get("grad_accum_dtype")
    model_dtype = dtype_name(derived.params_dtype)
    scaled = derived.fp16
    return PrecisionConfig(
        fp16=derived.fp16, bf16=derived.bf16, params_dtype=derived.params_dtype,
        loss_scale=(float(fp16["loss_scale"]) or None) if scaled else None,
        initial_loss_scale=2.0 ** fp16["initial_scale_power"] if scaled else None,
        min_loss_scale=fp16["min_loss_scale"] if scaled else None,
        loss_scale_window=fp16["loss_scale_window"] if scaled else None,
        hysteresis=fp16["hysteresis"] if scaled else None,
        grad_accum_dtype=canonical_dtype_name(accum) or model_dtype,
        gradient_accumulation_fusion=bool(flags.gradient_accumulation_fusion))


def _parallel_config(flags, derived: DerivedValues) -> ParallelConfig:
    launch = derived.launch
    return ParallelConfig(
        tensor_model_parallel_size=flags.tensor_model_parallel_size,
        pipeline_model_parallel_size=flags.pipeline_model_parallel_size,
        data_parallel_size=derived.data_parallel_size, world_size=launch.world_size, rank=launch.rank,
        local_rank=launch.local_rank, master_addr=launch.master_addr, master_port=launch.master_port,
        launcher=launch.source, distributed_backend=derived.distributed_backend, zero_stage=derived.zero_stage,
        pp_partition_method=flags.pp_partition_method or DEFAULT_PP_PARTITION_METHOD,
        sync_tp_duplicated_parameters=flags.sync_tp_duplicated_parameters, deterministic=flags.deterministic,
        sequence_parallel_size=flags.ds_sequence_parallel_size)


def _data_config(flags, derived: DerivedValues, tokenizer_vocab_size: int) -> DataConfig:
    return DataConfig(
        dataset=dataset_config_from_args(flags, derived.seq_length, tokenizer_vocab_size),
        tokenizer_type=flags.tokenizer_type,
        vocab_file=flags.vocab_file, merge_file=flags.merge_file,
        tokenizer_name_or_path=flags.tokenizer_name_or_path, tokenizer_model=flags.tokenizer_model,
        orig_vocab_size=tokenizer_vocab_size,
        dataloader_type=flags.dataloader_type or "single", num_workers=flags.num_workers,
        valid_num_workers=flags.valid_num_workers, eod_mask_loss=flags.eod_mask_loss,
        reset_position_ids=flags.reset_position_ids, reset_attention_mask=flags.reset_attention_mask)


def _fields_from_args(cls, flags, **overrides):
    names = [f.name for f in dataclasses.fields(cls) if f.name not in overrides]
    return cls(**{name: getattr(flags, name) for name in names}, **overrides)


def tokenizer_config_from_args(flags) -> TokenizerConfig:
    """The tokenizer flags as a TokenizerConfig."""
    return _fields_from_args(TokenizerConfig, flags)


def padded_vocab_size(flags, tokenizer_vocab_size: int) -> int:
    """The embedding's row count for this vocabulary under the flags (Megatron-DeepSpeed's padding rules)."""
    try:
        return vocab_size_with_padding(tokenizer_vocab_size, flags.make_vocab_size_divisible_by,
                                       flags.tensor_model_parallel_size, flags.pad_vocab_size_to)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None


def build_config(parsed: ParsedArguments, tokenizer_vocab_size: int) -> TrainConfig:
    """The TrainConfig of a parsed command line and a tokenizer of this vocabulary size."""
    flags, derived = parsed.flags, parsed.derived
    return TrainConfig(
        model=model_config_from_args(flags, derived, padded_vocab_size(flags, tokenizer_vocab_size)),
        parallel=_parallel_config(flags, derived), data=_data_config(flags, derived, tokenizer_vocab_size),
        optimizer=_fields_from_args(OptimizerConfig, flags, clip_grad=derived.clip_grad),
        schedule=_schedule_config(flags, derived),
        checkpoint=_fields_from_args(
            CheckpointConfig, flags, no_load_optim=bool(flags.no_load_optim), no_load_rng=bool(flags.no_load_rng),
            no_save_rng=bool(flags.no_save_rng),
            universal_checkpoint=bool(derived.ds_config.get("checkpoint", {}).get("load_universal")),
            save_interval_ranges=parse_interval_ranges(flags.save_interval_ranges or (), "--save-interval-ranges"),
            pinned_checkpoints=tuple(sorted(set(flags.pin_checkpoints or ())))),
        logging=_fields_from_args(LoggingConfig, flags, wandb_save_dir=wandb_directory(flags)),
        profile=ProfileConfig(enabled=flags.profile, step_start=flags.profile_step_start,
                              step_end=flags.profile_step_end, ranks=tuple(flags.profile_ranks),
                              directory=flags.tensorboard_dir),
        precision=_precision_config(flags, derived),
        deepspeed=DeepSpeedSettings(config_path=flags.deepspeed_config or flags.deepscale_config,
                                    config=copy.deepcopy(derived.ds_config)),
        abort_on_unmet_fused_kernel_constraints=flags.abort_on_unmet_fused_kernel_constraints,
        notices=derived.notices)


def flat_config(config: TrainConfig) -> dict[str, object]:
    """Every leaf of the config as ``"section.field": plain value`` (TensorBoard's text panel)."""
    flat = {}

    def visit(prefix, value):
        if isinstance(value, dict) and value:
            for key, item in value.items():
                visit(f"{prefix}.{key}" if prefix else key, item)
        else:
            flat[prefix] = value

    visit("", plain_value(config))
    return flat
