"""The accepted flags, in the groups and order of Megatron-DeepSpeed's ``--help``.

Names and defaults are Megatron-DeepSpeed's, with these deliberate differences (docs/compatibility.md):
``--zero-stage`` defaults to None (Megatron-DeepSpeed's 1.0 only toggled zero.Init; the effective
stage is the ds_config's), ``--tokenizer-type`` defaults to GPT2BPETokenizer (pretrain_gpt.py's
default there), ``--use-cpu-initialization`` is a plain store_true, integer flags accept "6_000_000"
and "10e6", and the ``type=bool`` flags read true/false. New flags: ``--lr-warmup-tokens``,
``--data-cache-path``, the ``inverse-square-root`` decay style and Megatron-LM's
``--wandb-project``, ``--wandb-exp-name``, ``--wandb-save-dir``, the FP8 flags (Megatron-LM's, and
the tests' ``--fp8-cpu-emulation``); ``--train-tokens`` and
``--codecarbon-dir`` work (no-ops in Megatron-DeepSpeed). ``--local_rank`` is also spelled
``--local-rank``. The offload flags ``--remote-device``, ``--use-pin-memory``, ``--cpu-optimizer`` and
``--cpu_torch_adam`` work as in Microsoft's Megatron-DeepSpeed, as ds_config keys (engine/ds_config.py).
The two misplaced flags of Megatron-DeepSpeed's ``--help`` are in their groups here:
``--kill-switch-path`` under "training", ``--log-level``/``--log-level-replica`` under "logging".
"""
import argparse

from megatron.core.models.gpt.config import GLU_ACTIVATIONS, NORMALIZATIONS, POSITION_EMBEDDING_TYPES
from megatron.core.tensor_parallel.fp8 import AMAX_COMPUTE_ALGOS, FP8_FORMATS, FP8_RECIPES
from megatron.core.tokenizer import REJECTED_TOKENIZER_TYPES, SUPPORTED_TOKENIZER_TYPES
from megatron.training.argument_types import parse_bool, parse_float, parse_int

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
DATA_IMPLS = ("lazy", "cached", "mmap", "infer")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` with "(default: X)" after each flag whose default says something: not for None,
    not for on/off switches (their help says what the switch does), not where the help names it."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (default is None or default is argparse.SUPPRESS or isinstance(default, bool)
                or "%(default)" in text or not action.option_strings):
            return text
        return text + " (default: %(default)s)"


def _profile_switch_only(value: str):
    """--profile is Megatron-LM's switch; Microsoft Megatron-DeepSpeed's form takes a value (pt, pt-full)."""
    raise argparse.ArgumentTypeError(
        f"takes no value here (got {value!r}: Microsoft Megatron-DeepSpeed's form); for torch.profiler "
        "traces give --profile --use-pytorch-profiler --profile-step-start A --profile-step-end B")


# Megatron-LM's names of the same position embeddings (its rope: GPT-NeoX's rotation, base 10000).
_MEGATRON_LM_POSITION_TYPES = {"learned_absolute": "absolute", "rope": "rotary"}


def _position_embedding_type(value: str) -> str:
    return _MEGATRON_LM_POSITION_TYPES.get(value, value)


def _normalization(value: str) -> str:
    """LayerNorm or RMSNorm, under Megatron-LM's spelling or Microsoft Megatron-DeepSpeed's lower case."""
    names = {name.lower(): name for name in NORMALIZATIONS}
    if value.lower() not in names:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(NORMALIZATIONS)}, got {value!r}")
    return names[value.lower()]


def _bool_value_flag(group, flag, help_text):
    group.add_argument(flag, type=parse_bool, nargs="?", const=True, default=None, metavar="BOOL",
                       help=help_text + " (true/false; the bare flag means true)")


def add_network_size_args(parser):
    """Add Megatron-DeepSpeed's "network size" flags to ``parser``."""
    group = parser.add_argument_group("network size")
    group.add_argument("--num-layers", type=parse_int, default=None, help="number of transformer layers L")
    group.add_argument("--hidden-size", type=parse_int, default=None, help="hidden size h")
    group.add_argument("--ffn-hidden-size", type=parse_int, default=None, help="MLP inner size (default 4h)")
    group.add_argument("--num-attention-heads", type=parse_int, default=None, help="attention heads n")
    group.add_argument("--kv-channels", type=parse_int, default=None, help="per-head dimension (default h/n)")
    group.add_argument("--max-position-embeddings", type=parse_int, default=None,
                       help="rows of the position table (absolute), the longest sequence (alibi, rotary); >= --seq-length")
    group.add_argument("--make-vocab-size-divisible-by", type=parse_int, default=128,
                       help="pad the vocabulary to a multiple of this times TP")
    group.add_argument("--pad-vocab-size-to", type=parse_int, default=None,
                       help="pad the vocabulary to exactly this size (independent of TP)")
    group.add_argument("--layernorm-epsilon", type=parse_float, default=1e-5,
                       help="epsilon of the normalization (LayerNorm or RMSNorm)")
    group.add_argument("--apply-residual-connection-post-layernorm", action="store_true",
                       help="BERT-style residual ordering (residual taken after the LayerNorm)")
    group.add_argument("--embed-layernorm", action="store_true", help="LayerNorm after the word embedding")
    group.add_argument("--openai-gelu", action="store_true", help="tanh approximation of GeLU")
    _bool_value_flag(group, "--onnx-safe", "erf GeLU for ONNX export (our exact GeLU already is the erf "
                     "form, so any value gives the same model)")
    group.add_argument("--position-embedding-type", choices=POSITION_EMBEDDING_TYPES, default="absolute",
                       type=_position_embedding_type,
                       help="absolute (learned), rotary or alibi (Megatron-LM's learned_absolute and rope "
                            "are the same as absolute and rotary)")
    group.add_argument("--glu-activation", choices=GLU_ACTIVATIONS, default=None,
                       help="gated MLP activation; needs --no-bias-gelu-fusion")
    add_llama_args(group)


def add_llama_args(group):
    """The model options of Llama-class GPTs, under Megatron-LM's names and Microsoft Megatron-DeepSpeed's."""
    group.add_argument("--normalization", type=_normalization, default="LayerNorm",
                       help="LayerNorm or RMSNorm (any case)")
    group.add_argument("--group-query-attention", action="store_true",
                       help="grouped-query attention with --num-query-groups key/value heads")
    group.add_argument("--num-query-groups", type=parse_int, default=None,
                       help="key/value groups g of --group-query-attention (1: multi-query)")
    group.add_argument("--num-key-value-heads", type=parse_int, default=None,
                       help="key/value heads (Microsoft Megatron-DeepSpeed's form of --group-query-attention "
                            "--num-query-groups)")
    group.add_argument("--swiglu", action="store_true",
                       help="SwiGLU MLP (--glu-activation swiglu --no-bias-gelu-fusion); --ffn-hidden-size "
                            "defaults to 8h/3 rounded down to a multiple of 64, as in Megatron-LM")
    group.add_argument("--use-rotary-position-embeddings", action="store_true",
                       help="--position-embedding-type rotary (Microsoft Megatron-DeepSpeed's form)")
    group.add_argument("--rotary-base", "--rope-theta", "--rotary-position-embeddings-theta", type=parse_float,
                       default=10000.0, help="base of the rotary frequencies")
    group.add_argument("--rotary-percent", type=parse_float, default=1.0,
                       help="share of each head's channels that rotate")
    group.add_argument("--use-rope-scaling", action="store_true",
                       help="Llama 3's rope frequency scaling (the four --rope-scaling-* settings)")
    group.add_argument("--rope-scaling-factor", type=parse_float, default=8.0, help="Llama 3 rope scaling factor")
    group.add_argument("--rope-scaling-low-freq-factor", type=parse_float, default=1.0,
                       help="Llama 3 rope scaling: low frequency factor")
    group.add_argument("--rope-scaling-high-freq-factor", type=parse_float, default=4.0,
                       help="Llama 3 rope scaling: high frequency factor")
    group.add_argument("--rope-scaling-original-max-position-embeddings", type=parse_int, default=8192,
                       help="Llama 3 rope scaling: the context the model was first trained for")
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                       help="the output layer has its own weights")
    group.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                       help="no biases in the linear layers")
    group.add_argument("--add-qkv-bias", action="store_true",
                       help="a bias on the query/key/value projection even with --disable-bias-linear (Qwen2)")


def add_regularization_args(parser):
    """Add Megatron-DeepSpeed's "regularization" flags to ``parser``."""
    group = parser.add_argument_group("regularization")
    group.add_argument("--attention-dropout", type=parse_float, default=0.1, help="attention-probability dropout")
    group.add_argument("--hidden-dropout", type=parse_float, default=0.1,
                       help="dropout of hidden states, residuals and embeddings")
    group.add_argument("--weight-decay", type=parse_float, default=0.01,
                       help="decoupled weight decay (not applied to biases and norm weights)")
    group.add_argument("--clip-grad", type=parse_float, default=1.0,
                       help="global L2 gradient clipping; the ds_config's gradient_clipping wins")
    group.add_argument("--adam-beta1", type=parse_float, default=0.9, help="Adam beta1")
    group.add_argument("--adam-beta2", type=parse_float, default=0.999, help="Adam beta2")
    group.add_argument("--adam-eps", type=parse_float, default=1e-8, help="Adam epsilon")
    group.add_argument("--sgd-momentum", type=parse_float, default=0.9, help="SGD momentum")


def add_recompute_args(group):
    """Megatron-LM's activation recompute flags (megatron.training.config.recompute_settings combines
    them with --checkpoint-activations / --checkpoint-num-layers)."""
    group.add_argument("--recompute-activations", action="store_true",
                       help="selective recompute (same as --recompute-granularity selective)")
    group.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                       help="full: whole layers (--recompute-method, --recompute-num-layers); selective: "
                            "--recompute-modules inside every layer")
    group.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                       help="full recompute: uniform = chunks of N layers checkpointed as a unit (default); "
                            "block = the first N layers of each pipeline stage, one by one, the rest not")
    group.add_argument("--recompute-num-layers", type=parse_int, default=None,
                       help="N of --recompute-method (default 1; same as --checkpoint-num-layers)")
    group.add_argument("--recompute-modules", nargs="+", default=None, metavar="MODULE",
                       help="selective recompute's modules: core_attn, layernorm, mlp_act, mlp "
                            "(default layernorm mlp_act)")


def add_training_args(parser):
    """Add Megatron-DeepSpeed's "training" flags to ``parser``."""
    group = parser.add_argument_group("training")
    group.add_argument("--micro-batch-size", type=parse_int, default=None, help="samples per GPU per micro step")
    group.add_argument("--global-batch-size", type=parse_int, default=None,
                       help="samples per optimizer step (default micro batch x data parallel size)")
    group.add_argument("--rampup-batch-size", type=parse_int, nargs=3, default=None,
                       metavar=("START", "INCREMENT", "RAMP_SAMPLES"),
                       help="ramp the global batch from START by INCREMENT over RAMP_SAMPLES samples")
    group.add_argument("--checkpoint-activations", action="store_true", help="recompute activations in backward")
    group.add_argument("--distribute-checkpointed-activations", action="store_true",
                       help="keep 1/TP of each checkpointed activation per rank (same as --partition-activations)")
    group.add_argument("--checkpoint-num-layers", type=parse_int, default=1, help="layers per checkpointed chunk")
    add_recompute_args(group)
    group.add_argument("--train-iters", type=parse_int, default=None, help="total iterations")
    group.add_argument("--train-samples", type=parse_int, default=None, help="total samples")
    group.add_argument("--train-tokens", type=parse_int, default=None,
                       help="also stop when this many tokens have been consumed")
    group.add_argument("--log-interval", type=parse_int, default=100, help="iterations between log lines")
    group.add_argument("--exit-interval", type=parse_int, default=None,
                       help="save and exit when the iteration is a multiple of this")
    group.add_argument("--exit-duration-in-mins", type=parse_int, default=None,
                       help="save and exit after this many minutes")
    group.add_argument("--kill-switch-path", default=None,
                       help="when this file exists: exit at start, or save a checkpoint and exit")
    group.add_argument("--skip-train-iteration-range", nargs="+", default=None, metavar="START-END",
                       help="iterations to skip: each draws its global batch and discards it, advances the counters "
                            "and makes no update (e.g. 1000-1200 3000-3010)")
    group.add_argument("--max-consecutive-nan-iterations", type=parse_int, default=20,
                       help="save and stop after this many iterations in a row with a NaN or Inf loss or gradient "
                            "norm (each makes no update); 0 never stops")
    group.add_argument("--exit-signal-handler", action="store_true",
                       help="save a checkpoint and exit 0 on SIGTERM, SIGINT or SIGUSR1 (always on; the flag "
                            "is Megatron-LM's and accepted for its scripts)")
    group.add_argument("--tensorboard-dir", default=None, help="TensorBoard output directory")
    group.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false",
                       help="do not fuse scale, mask and softmax")
    group.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false",
                       help="do not fuse bias and GeLU (exact erf GeLU)")
    group.add_argument("--no-bias-dropout-fusion", dest="bias_dropout_fusion", action="store_false",
                       help="do not fuse bias, dropout and residual add")
    group.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                       help="adam (with decoupled weight decay) or sgd")
    group.add_argument("--use-bnb-optimizer", action="store_true",
                       help="adam as bitsandbytes' 8-bit AdamW, with a stable embedding (LayerNorm, Xavier "
                            "init, 32-bit optimizer state); needs the 'bnb' extra")
    group.add_argument("--dataloader-type", choices=("single", "cyclic"), default=None,
                       help="single (resumable, sequential) or cyclic (reshuffled every epoch); default single")
    group.add_argument("--codecarbon-dir", default=None, help="record energy and emissions with codecarbon here")
    _bool_value_flag(group, "--eval-only", "skip training: only evaluate on the validation and test sets")
    group.add_argument("--abort-on-unmet-fused-kernel-constraints", action="store_true",
                       help="exit instead of falling back when a fused kernel cannot serve the configured shapes")
    group.add_argument("--pp-partition-method", default=None,
                       help="DeepSpeed PipelineModule partition method: uniform, parameters, type:<regex> "
                            "(default type:transformer), or flops (stages balanced by forward FLOPs)")


def add_initialization_args(parser):
    """Add Megatron-DeepSpeed's "initialization" flags to ``parser``."""
    group = parser.add_argument_group("initialization")
    group.add_argument("--seed", type=parse_int, default=1234, help="random seed (stage seed is seed + 100 pp_rank)")
    group.add_argument("--init-method-std", type=parse_float, default=0.02, help="std of the normal initialization")


def add_learning_rate_args(parser):
    """Add Megatron-DeepSpeed's "learning rate" flags to ``parser``."""
    group = parser.add_argument_group("learning rate")
    group.add_argument("--lr", type=parse_float, default=None, help="peak learning rate")
    group.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="linear", help="decay shape")
    group.add_argument("--lr-decay-iters", type=parse_int, default=None,
                       help="decay length in iterations (default --train-iters)")
    group.add_argument("--lr-decay-samples", type=parse_int, default=None,
                       help="decay length in samples (default --train-samples)")
    group.add_argument("--lr-decay-tokens", type=parse_int, default=None,
                       help="decay length in tokens (replaces the iteration/sample decay)")
    group.add_argument("--lr-warmup-fraction", type=parse_float, default=None,
                       help="warmup as a fraction of the decay length")
    group.add_argument("--lr-warmup-iters", type=parse_int, default=0, help="warmup in iterations")
    group.add_argument("--lr-warmup-samples", type=parse_int, default=0, help="warmup in samples")
    group.add_argument("--lr-warmup-tokens", type=parse_int, default=None, help="warmup in tokens")
    group.add_argument("--min-lr", type=parse_float, default=0.0, help="learning-rate floor")
    group.add_argument("--override-lr-scheduler", action="store_true",
                       help="on resume, keep these flags' schedule (lr, min lr, warmup, decay) instead of the "
                            "checkpoint's; its progress (samples, tokens) continues")
    group.add_argument("--use-checkpoint-lr-scheduler", action="store_true",
                       help="on resume, take the schedule's settings from the checkpoint instead of these flags")


def add_checkpointing_args(parser):
    """Add Megatron-DeepSpeed's "checkpointing" flags to ``parser``."""
    group = parser.add_argument_group("checkpointing")
    group.add_argument("--save", default=None, help="checkpoint directory to save to")
    group.add_argument("--save-interval", type=parse_int, default=None, help="iterations between saves")
    group.add_argument("--no-save-rng", action="store_true", default=None, help="do not save the RNG states")
    group.add_argument("--load", default=None, help="checkpoint directory to resume from")
    group.add_argument("--no-load-optim", action="store_true", default=None,
                       help="do not load the optimizer state (the LR schedule and the counters still load)")
    group.add_argument("--no-load-rng", action="store_true", default=None, help="do not load the RNG states")
    group.add_argument("--save-interval-ranges", nargs="+", default=None, metavar="START-END:INTERVAL",
                       help="other save intervals within iteration ranges, e.g. 1-100:10 101-1000:50 (--save-interval "
                            "applies outside them)")
    group.add_argument("--keep-last-checkpoints", type=parse_int, default=None,
                       help="after each save, delete all but the last K checkpoints (never the one latest names, "
                            "never a pinned one)")
    group.add_argument("--pin-checkpoints", type=parse_int, nargs="+", default=None, metavar="ITERATION",
                       help="iterations whose checkpoints --keep-last-checkpoints never deletes")
    group.add_argument("--overwrite-checkpoints", action="store_true",
                       help="start at iteration 0 although --save holds checkpoints (they are replaced as the run "
                            "reaches their iterations); without it such a run is refused")
    group.add_argument("--allow-missing-manifest", action="store_true",
                       help="load a checkpoint of this trainer whose manifest.json is missing, its files unverified "
                            "(a damaged file goes unnoticed); without it such a checkpoint is refused")
    group.add_argument("--universal-checkpoint", action="store_true",
                       help="resume from the universal checkpoint that latest_universal names "
                            "(tools/convert_checkpoint/ds_to_universal.py), under any TP, PP and DP size")
    group.add_argument("--finetune", action="store_true",
                       help="load the weights and start at iteration 0 (with the DeepSpeed engine the "
                            "optimizer is loaded too unless --no-load-optim)")


def add_mixed_precision_args(parser):
    """Add Megatron-DeepSpeed's "mixed precision" flags to ``parser``."""
    group = parser.add_argument_group("mixed precision")
    group.add_argument("--fp16", action="store_true", help="fp16 parameters (CUDA only); see ds_config fp16")
    group.add_argument("--bf16", action="store_true", help="bf16 parameters; see ds_config bf16")
    group.add_argument("--loss-scale", type=parse_float, default=None,
                       help="static loss scale (default dynamic); the ds_config's fp16.loss_scale wins")
    group.add_argument("--initial-loss-scale", type=parse_float, default=2.0 ** 32,
                       help="initial dynamic loss scale, a power of 2; fp16.initial_scale_power wins")
    group.add_argument("--min-loss-scale", type=parse_float, default=1.0,
                       help="minimum dynamic loss scale; fp16.min_loss_scale wins")
    group.add_argument("--loss-scale-window", type=parse_float, default=1000,
                       help="iterations without overflow before doubling; fp16.loss_scale_window wins")
    group.add_argument("--hysteresis", type=parse_int, default=2,
                       help="overflows tolerated before halving; fp16.hysteresis wins")
    group.add_argument("--fp32-residual-connection", action="store_true", help="residual stream in fp32")
    group.add_argument("--no-query-key-layer-scaling", dest="apply_query_key_layer_scaling",
                       action="store_false", help="do not scale the attention scores by 1/layer_number")
    group.add_argument("--attention-softmax-in-fp32", action="store_true", help="softmax in fp32")
    group.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false",
                       help="under bf16 with fp32 gradient accumulation, let autograd return each linear layer's "
                            "bf16 weight gradient for DeepSpeed to add into its fp32 accumulator, instead of the "
                            "weight-gradient GEMM adding into the accumulator itself")


def add_distributed_args(parser):
    """Add Megatron-DeepSpeed's "distributed" flags to ``parser``."""
    group = parser.add_argument_group("distributed")
    group.add_argument("--tensor-model-parallel-size", type=parse_int, default=1, help="TP degree")
    group.add_argument("--pipeline-model-parallel-size", type=parse_int, default=1, help="PP degree")
    group.add_argument("--sequence-parallel", action="store_true",
                       help="with TP > 1, split the activations outside the TP regions (norms, dropouts, "
                            "residual adds) along the sequence over the TP ranks: reduce-scatter and all-gather "
                            "instead of all-reduce (no effect at TP 1)")
    group.add_argument("--tp-comm-overlap", action="store_true",
                       help="with --sequence-parallel, pipeline each all-gather and reduce-scatter of the TP "
                            "group with its GEMM through symmetric GPU memory (NVLink peer copies while the GEMM "
                            "runs; the TP group must sit on one node); keeps the gathered GEMM inputs for backward")
    group.add_argument("--ds-sequence-parallel-size", type=parse_int, default=1,
                       help="DeepSpeed-Ulysses sequence parallelism: S ranks of each data-parallel line read the "
                            "same samples, each holding 1 / S of the positions; attention all-to-alls to the "
                            "whole sequence on 1 / S of the heads. World = TP x PP x S x DP")
    group.add_argument("--distributed-backend", choices=("nccl", "gloo"), default="nccl",
                       help="collective backend (gloo is used automatically without CUDA)")
    group.add_argument("--local_rank", "--local-rank", dest="local_rank", type=parse_int, default=None,
                       help="set by the launcher")
    _bool_value_flag(group, "--lazy-mpu-init", "defer the model-parallel init (only false is supported)")
    group.add_argument("--deterministic", action="store_true",
                       help="bitwise-reproducible GPU runs: deterministic kernels only (torch's deterministic "
                            "algorithms, cuBLAS workspace, attention through the materialized path); slower")
    group.add_argument("--sync-tp-duplicated-parameters", action="store_true",
                       help="after every step, make the parameters every TP rank holds whole (layer norms, "
                            "row-parallel biases) equal to TP rank 0's, bit for bit, and report any drift")
    group.add_argument("--use-cpu-initialization", action="store_true",
                       help="initialize weights on CPU, identical under every TP/PP layout")


def add_validation_args(parser):
    """Add Megatron-DeepSpeed's "validation" flags to ``parser``."""
    group = parser.add_argument_group("validation")
    group.add_argument("--eval-iters", type=parse_int, default=100,
                       help="iterations per evaluation (0 disables validation and test)")
    group.add_argument("--eval-interval", type=parse_int, default=1000, help="iterations between evaluations")


def add_data_args(parser):
    """Add Megatron-DeepSpeed's "data and dataloader" flags to ``parser``."""
    group = parser.add_argument_group("data and dataloader")
    group.add_argument("--data-path", nargs="*", default=None, help="PREFIX or W1 PREFIX1 W2 PREFIX2 ...")
    group.add_argument("--split", default=None, help='train/valid/test proportions (default "969, 30, 1")')
    for split in ("train", "valid", "test"):
        group.add_argument(f"--{split}-weighted-split-paths", nargs="*", default=None,
                           help=f'{split} groups "NAME: W1 S1:E1 PATH1, W2 S2:E2 PATH2"')
        group.add_argument(f"--{split}-weighted-split-paths-path", default=None,
                           help=f"file holding the {split} groups, double-quoted")
    group.add_argument("--data-cache-path", default=None, help="directory for the index caches")
    group.add_argument("--log-path", default=None, help="directory for the arguments listing")
    group.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocabulary (vocab.json)")
    group.add_argument("--merge-file", default=None, help="GPT-2 BPE merges (merges.txt)")
    group.add_argument("--seq-length", type=parse_int, default=None, help="training sequence length")
    group.add_argument("--encoder-seq-length", type=parse_int, default=None, help="alias of --seq-length")
    group.add_argument("--mmap-warmup", action="store_true", help="read the data files once at start")
    group.add_argument("--num-workers", type=parse_int, default=2, help="training DataLoader workers")
    group.add_argument("--valid-num-workers", type=parse_int, default=2, help="validation DataLoader workers")
    group.add_argument("--tokenizer-type", choices=SUPPORTED_TOKENIZER_TYPES + REJECTED_TOKENIZER_TYPES,
                       default="GPT2BPETokenizer", help="tokenizer")
    group.add_argument("--tokenizer-name-or-path", default=None, help="local HF tokenizer directory")
    group.add_argument("--tokenizer-model", default=None,
                       help="tokenizer file: a SentencePiece model (SentencePieceTokenizer) or a tokenizer.json "
                            "(HuggingFaceTokenizer)")
    group.add_argument("--data-impl", choices=DATA_IMPLS, default="infer",
                       help="mmap, or infer from the files (lazy and cached are legacy, refused)")
    group.add_argument("--reset-position-ids", action="store_true", help="restart position ids after each EOD")
    group.add_argument("--reset-attention-mask", action="store_true", help="no attention across EOD")
    group.add_argument("--eod-mask-loss", action="store_true", help="no loss on EOD tokens")


def add_logging_args(parser):
    """Add Megatron-DeepSpeed's "logging" flags to ``parser``."""
    group = parser.add_argument_group("logging")
    group.add_argument("--log-params-norm", action="store_true", help="log the L2 norm of all parameters")
    group.add_argument("--log-num-zeros-in-grad", action="store_true", help="log the count of zero gradients")
    group.add_argument("--tensorboard-log-interval", type=parse_int, default=1,
                       help="iterations between TensorBoard scalars")
    group.add_argument("--tensorboard-queue-size", type=parse_int, default=1000, help="SummaryWriter max_queue")
    group.add_argument("--log-timers-to-tensorboard", action="store_true", help="write time/* scalars")
    group.add_argument("--log-batch-size-to-tensorboard", action="store_true", help="write batch-size/*")
    group.add_argument("--no-log-learnig-rate-to-tensorboard", dest="log_learning_rate_to_tensorboard",
                       action="store_false", help="do not write learning-rate/* (sic: Megatron-DeepSpeed's spelling)")
    group.add_argument("--no-log-loss-scale-to-tensorboard", dest="log_loss_scale_to_tensorboard",
                       action="store_false", help="do not write loss-scale/*")
    group.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                       help="also write validation perplexity")
    group.add_argument("--profile", nargs="?", const=True, default=False, type=_profile_switch_only,
                       help="profile iterations --profile-step-start + 1 .. --profile-step-end on --profile-ranks "
                            "(Megatron-LM's flag; needs --use-pytorch-profiler)")
    group.add_argument("--use-pytorch-profiler", action="store_true",
                       help="profile with torch.profiler: a trace and an operator table per rank in --tensorboard-dir")
    group.add_argument("--profile-step-start", type=parse_int, default=10,
                       help="the iteration after which profiling starts")
    group.add_argument("--profile-step-end", type=parse_int, default=12, help="the last iteration profiled")
    group.add_argument("--profile-ranks", type=parse_int, nargs="+", default=[0], help="the global ranks to profile")
    group.add_argument("--wandb-project", default=None,
                       help="log the TensorBoard scalars to this Weights & Biases project too (Megatron-LM's flag; "
                            "needs the 'wandb' extra; offline when WANDB_MODE=offline or no W&B server answers)")
    group.add_argument("--wandb-exp-name", default=None, help="the W&B run's name (default: W&B's own)")
    group.add_argument("--wandb-save-dir", default=None,
                       help="directory of the W&B run files (default: the wandb/ directory in --save)")
    group.add_argument("--log-level", choices=LOG_LEVELS, default=None, help="log level of rank 0")
    group.add_argument("--log-level-replica", choices=LOG_LEVELS, default=None,
                       help="log level of the other ranks")


def add_zero_args(parser):
    """Add Megatron-DeepSpeed's "ZeRO" flags to ``parser``."""
    group = parser.add_argument_group("ZeRO")
    group.add_argument("--zero-stage", type=parse_int, default=None,
                       help="ZeRO stage 0, 1, 2 or 3 (3 needs PP 1); must match the ds_config's "
                            "zero_optimization.stage")
    group.add_argument("--remote-device", choices=("none", "cpu", "nvme"), default="none",
                       help="ZeRO-3: where the parameter partitions live; cpu is the ds_config's "
                            "zero_optimization.offload_param.device \"cpu\" (nvme is refused)")
    group.add_argument("--use-pin-memory", action="store_true",
                       help="with --remote-device cpu: the parameter partitions in pinned CPU memory "
                            "(offload_param.pin_memory)")
    group.add_argument("--cpu-optimizer", action="store_true",
                       help="run the optimizer on the CPU: the ds_config's zero_optimization.offload_optimizer."
                            "device \"cpu\" (ZeRO 1-3), DeepSpeed's CPU Adam")
    group.add_argument("--cpu_torch_adam", action="store_true",
                       help="with the optimizer on the CPU: torch's AdamW instead of DeepSpeed's CPU Adam "
                            "(zero_force_ds_cpu_optimizer false; slower, needs no compiled op)")


def add_activation_checkpointing_args(parser):
    """Add Megatron-DeepSpeed's "activation checkpointing" flags to ``parser``."""
    group = parser.add_argument_group("activation checkpointing")
    group.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                       help="accepted for Megatron-DeepSpeed's scripts: our checkpointing already replays the "
                            "model-parallel RNG as DeepSpeed's did")
    group.add_argument("--partition-activations", action="store_true",
                       help="keep 1/TP of each checkpointed activation per rank")


def add_fp8_args(parser):
    """Add Megatron-LM's FP8 flags to ``parser`` (megatron/core/tensor_parallel/fp8.py has the math)."""
    group = parser.add_argument_group("FP8")
    group.add_argument("--fp8-format", choices=FP8_FORMATS, default=None,
                       help="run the GEMMs of the transformer layers' linear layers in FP8 (forward and both "
                            "backward GEMMs; master weights and optimizer unchanged): e4m3 for every operand, or "
                            "hybrid (e4m3 inputs and weights, e5m2 gradients). Absent: no FP8")
    group.add_argument("--fp8-recipe", choices=FP8_RECIPES, default="delayed",
                       help="scales: delayed (from the amax history of earlier steps), tensorwise (each tensor's "
                            "current amax) or rowwise (each GEMM row's current amax)")
    group.add_argument("--fp8-amax-history-len", type=parse_int, default=1,
                       help="delayed scaling: steps of amax history kept per tensor")
    group.add_argument("--fp8-amax-compute-algo", choices=AMAX_COMPUTE_ALGOS, default="most_recent",
                       help="delayed scaling: the amax a scale is made from, the history's max or its most recent")
    group.add_argument("--fp8-margin", type=parse_int, default=0,
                       help="scales leave 2^margin of headroom: s = fp8_max / (amax 2^margin)")
    group.add_argument("--first-last-layers-bf16", action="store_true",
                       help="with --fp8-format, keep the GEMMs of the first and last transformer layers in the "
                            "model's precision (counts: --num-layers-at-start-in-bf16, --num-layers-at-end-in-bf16)")
    group.add_argument("--num-layers-at-start-in-bf16", type=parse_int, default=1,
                       help="with --first-last-layers-bf16: the first transformer layers kept out of FP8")
    group.add_argument("--num-layers-at-end-in-bf16", type=parse_int, default=1,
                       help="with --first-last-layers-bf16: the last transformer layers kept out of FP8")
    group.add_argument("--fp8-cpu-emulation", action="store_true",
                       help="for tests: FP8 without FP8 GEMMs, each operand quantized with the recipe's scales and "
                            "dequantized around a plain fp32 matmul (runs on CPU; no speed-up)")


ARGUMENT_GROUPS = (add_network_size_args, add_regularization_args, add_training_args,
                   add_initialization_args, add_learning_rate_args, add_checkpointing_args,
                   add_mixed_precision_args, add_distributed_args, add_validation_args, add_data_args,
                   add_logging_args, add_zero_args, add_activation_checkpointing_args, add_fp8_args)
