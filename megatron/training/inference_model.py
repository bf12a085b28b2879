"""The model of a training checkpoint, run for inference with one process per rank, as training runs.

What the generation tools and the evaluation commands call (every rank of the launch, together):

    from megatron.training.initialize import select_accelerator
    select_accelerator()                                     # before anything imports deepspeed
    from megatron.training.inference_model import (InferenceSetupError, load_inference_model,
                                                   parse_inference_arguments)

    arguments = parse_inference_arguments(argv, add_flags)   # argv parsed once; add_flags(parser) adds
                                                             # the tool's flags: arguments.tool
    model = load_inference_model(arguments)                  # collective
    logits = model.logits(tokens)                            # tokens [b, s] int, the same on every rank,
                                                             # s <= model.seq_length -> [b, s, padded V]
                                                             # fp32, the same on every rank of the replica
    model.tokenizer, model.seq_length, model.config (config.InferenceConfig: model, parallel, seed, ...)
    model.groups                                             # ParallelGroups: dp_rank, dp_size, dp group
    model.forward                                            # PipelineForward (cached generation)
    model.generate_text(prompts, max_new_tokens, SamplingParams(...), generator)   # collective
    model.shutdown()                                         # collective: tear the process group down

The command line is the trainer's flags (model, tokenizer, checkpoint, precision and parallel
flags; training-only flags are accepted and ignored, none is required) plus the tool's, which
``add_flags`` declares on a parser of their own. What the model needs becomes an InferenceConfig
(megatron/training/config.py), the typed configuration load_inference_model builds from. The model
configuration is the checkpoint's; a model flag given with another value is refused by name.
``--load`` is a --save directory (its ``latest``) or a ``global_stepN`` directory; only the model's
weights are read (``--no-load-optim`` / ``--no-load-rng`` are what happens anyway).

Layout: launched like training (python for one process; deepspeed, torchrun or srun for several),
TP and PP are --tensor-model-parallel-size / --pipeline-model-parallel-size when given, else the
checkpoint's; any other layout works as well (its weights are re-cut on load, stage_model.py). The
world size must be a multiple of TP x PP; the rest are data-parallel replicas, each a whole model.

Precision: ``params_dtype`` when given (e.g. fp32 for an evaluation of a bf16 checkpoint), else
--fp16 / --bf16, else the dtype the checkpoint was trained in. CPU (gloo) or GPU (NCCL, one GPU a rank).
On one GPU (TP = PP = 1) generation uses the fixed-size cache and replays its decoding steps from
CUDA graphs (megatron/core/text_generation/forward.py).
"""
import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron.core.checkpoint.model_loading import gpt_model_config
from megatron.core.checkpoint.reader import SavedCheckpoint, open_checkpoint
from megatron.core.parallel_state import ParallelGroups
from megatron.core.text_generation.forward import PipelineForward
from megatron.core.text_generation.generation import generate
from megatron.core.text_generation.sampling import SamplingParams
from megatron.core.text_generation.stage_model import InferenceStage, load_stage_weights
from megatron.core.tokenizer import build_tokenizer, prompt_tokens
from megatron.training.argument_types import ErrorRaisingParser
from megatron.training.arguments import ReadOnlyNamespace, build_parser, explicit_dests
from megatron.training.config import InferenceConfig, ProcessLayout, TokenizerConfig, tokenizer_config_from_args
from megatron.training.dist_utils import shutdown
from megatron.training.engine.replacements import check_deepspeed
from megatron.training.engine.model_setup import current_device
from megatron.training.initialize import initialize_distributed, set_random_seeds
from megatron.training.launch_env import effective_backend, rank_in_environment, read_launch_env

# Flags whose value, when given, must be the checkpoint's (dest = the saved configuration's key).
MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels",
               "max_position_embeddings", "position_embedding_type", "glu_activation", "embed_layernorm",
               "apply_residual_connection_post_layernorm", "openai_gelu", "layernorm_epsilon", "normalization",
               "num_query_groups", "untie_embeddings_and_output_weights", "add_qkv_bias",
               "rotary_base", "rotary_percent", "use_rope_scaling")


class InferenceSetupError(ValueError):
    """The command line, launch or checkpoint cannot give a model; the message names the flag or file."""


@dataclass
class InferenceModel:
    """A checkpoint's model on this rank's stage (module docstring)."""

    config: InferenceConfig
    checkpoint: SavedCheckpoint
    groups: ParallelGroups
    tokenizer: object
    forward: PipelineForward
    device: torch.device

    @property
    def seq_length(self) -> int:
        return self.config.seq_length

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] (s <= seq_length) -> logits [b, s, padded V] fp32; collective over the replica."""
        if tokens.shape[-1] > self.seq_length:
            raise InferenceSetupError(f"{tokens.shape[-1]} tokens: the model takes at most --seq-length "
                                      f"{self.seq_length}")
        return self.forward.logits(tokens.to(self.device))

    def generate_text(self, prompts: Sequence[str], max_new_tokens: int, params: SamplingParams,
                      generator: torch.Generator | None = None, use_cache: bool = True) -> list["GeneratedText"]:
        """Continue each prompt (text, after the tokenizer's BOS where it has one; "" starts from the
        BOS, else from the end-of-document token: an unconditional sample) by up to ``max_new_tokens``
        tokens; collective, the same prompts on every rank.
        GenerationInputError names a prompt that is too long for --seq-length."""
        tokenizer = self.tokenizer
        token_lists = [prompt_tokens(tokenizer, prompt) for prompt in prompts]
        output = generate(self.forward, token_lists, max_new_tokens, params, eod=tokenizer.eod,
                          vocab_size=tokenizer.vocab_size, max_length=self.seq_length, use_cache=use_cache,
                          generator=generator, device=self.device)
        samples = []
        for row, prompt in enumerate(prompts):
            tokens = output.continuation(row)
            finished = bool(tokens) and tokens[-1] == tokenizer.eod
            text = tokenizer.detokenize(tokens[:-1] if finished else tokens)
            samples.append(GeneratedText(prompt, text, tokens, token_lists[row], finished))
        return samples

    def token_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """log p(x_t | x_<t) for t >= 1 of each token sequence (each <= seq_length), the softmax over
        the tokenizer's vocabulary; one forward of the batch, collective."""
        longest = max(len(sequence) for sequence in sequences)
        tokens = torch.full((len(sequences), longest), self.tokenizer.eod, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            tokens[row, :len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        logits = self.logits(tokens)[:, :-1, :self.tokenizer.vocab_size]  # [b, s - 1, V]: predicts 1 .. s - 1
        targets = tokens[:, 1:].to(logits.device)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
        return [logprobs[row, :len(sequence) - 1].tolist() for row, sequence in enumerate(sequences)]

    def shutdown(self) -> None:
        shutdown()


@dataclass(frozen=True)
class GeneratedText:
    """prompt and its continuation ``text`` (decoded ``tokens``, the end-of-document token left out of
    the text); ``finished``: the model ended the document (else a length limit stopped it)."""

    prompt: str
    text: str
    tokens: list[int]
    prompt_tokens: list[int]
    finished: bool


@dataclass(frozen=True)
class InferenceArguments:
    """An inference tool's command line, parsed once.

    Attributes:
        flags: the trainer's flags as argparse read them (defaults included), read-only.
        explicit: the dests of the trainer's flags given on the command line.
        tool: the flags the tool's ``add_flags`` declared, read-only.
    """

    flags: argparse.Namespace
    explicit: frozenset[str]
    tool: argparse.Namespace


def parse_inference_arguments(argv: Sequence[str] | None = None,
                              add_flags: Callable | None = None) -> InferenceArguments:
    """``argv`` (default sys.argv[1:]): the tool's flags (``add_flags(parser)`` declares them) are taken
    out first, the rest are the trainer's flags; no validation of training flags, but the installed
    DeepSpeed is checked (engine/replacements.py). -h / --help prints both."""
    argv = sys.argv[1:] if argv is None else list(argv)
    tool_parser = ErrorRaisingParser(add_help=False, allow_abbrev=False)
    if add_flags is not None:
        add_flags(tool_parser)
    if {"-h", "--help"} & set(argv):
        help_parser = build_parser()
        if add_flags is not None:
            add_flags(help_parser)
        help_parser.print_help()
        sys.exit(0)
    tool, trainer_argv = tool_parser.parse_known_args(argv)
    flags = ReadOnlyNamespace(build_parser().parse_args(trainer_argv))
    for warning in check_deepspeed(flags.allow_untested_deepspeed):
        print(warning, flush=True)
    return InferenceArguments(flags, explicit_dests(trainer_argv), ReadOnlyNamespace(tool))


def check_model_flags(arguments: InferenceArguments, checkpoint: SavedCheckpoint) -> None:
    """Every model flag given must have the checkpoint's value."""
    for dest in MODEL_FLAGS:
        given, saved = getattr(arguments.flags, dest), checkpoint.model.get(dest)
        if dest in arguments.explicit and given != saved:
            raise InferenceSetupError(f"--{dest.replace('_', '-')} {given}: the checkpoint at --load "
                                      f"{checkpoint.directory} was trained with {saved}")


def model_dtype(flags, params_dtype: torch.dtype | None) -> dict:
    """The params_dtype override: ``params_dtype``, else --bf16 / --fp16, else none (the checkpoint's)."""
    if params_dtype is not None:
        return {"params_dtype": params_dtype}
    if flags.bf16:
        return {"params_dtype": torch.bfloat16}
    if flags.fp16:
        return {"params_dtype": torch.float16}
    return {}


def process_layout(arguments: InferenceArguments, checkpoint: SavedCheckpoint) -> ProcessLayout:
    """The run's layout: the launcher's ranks, TP and PP from the flags when given, else the checkpoint's."""
    flags, explicit = arguments.flags, arguments.explicit
    launch = read_launch_env(os.environ, flags.local_rank)
    tp = flags.tensor_model_parallel_size if "tensor_model_parallel_size" in explicit else checkpoint.tp
    pp = flags.pipeline_model_parallel_size if "pipeline_model_parallel_size" in explicit else checkpoint.pp
    if launch.world_size % (tp * pp):
        raise InferenceSetupError(f"{launch.world_size} processes cannot hold TP {tp} x PP {pp} (the checkpoint was "
                                  f"saved with TP {checkpoint.tp} x PP {checkpoint.pp}): launch a multiple of "
                                  f"{tp * pp} processes or give --tensor-model-parallel-size and "
                                  f"--pipeline-model-parallel-size")
    backend, _ = effective_backend(flags.distributed_backend, torch.cuda.is_available(), explicit=False)
    return ProcessLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         data_parallel_size=launch.world_size // (tp * pp), world_size=launch.world_size,
                         rank=launch.rank, local_rank=launch.local_rank, master_addr=launch.master_addr,
                         master_port=launch.master_port, launcher=launch.source, distributed_backend=backend,
                         deterministic=False)


def checked_seq_length(flags, checkpoint: SavedCheckpoint) -> int:
    """--seq-length, else the checkpoint's; never more than the model's positions."""
    seq_length = flags.seq_length or checkpoint.model["seq_length"]
    positions = checkpoint.model.get("max_position_embeddings")
    if positions and seq_length > positions:
        raise InferenceSetupError(f"--seq-length {seq_length}: the model has {positions} positions")
    return seq_length


def checked_tokenizer(config: TokenizerConfig, checkpoint: SavedCheckpoint):
    """The configured tokenizer, refused when it has more tokens than the checkpoint's vocabulary."""
    tokenizer = build_tokenizer(config.tokenizer_type, vocab_file=config.vocab_file, merge_file=config.merge_file,
                                tokenizer_name_or_path=config.tokenizer_name_or_path,
                                tokenizer_model=config.tokenizer_model)
    if tokenizer.vocab_size > checkpoint.model["padded_vocab_size"]:
        raise InferenceSetupError(f"the tokenizer has {tokenizer.vocab_size} tokens, the checkpoint's model "
                                  f"{checkpoint.model['padded_vocab_size']}: not the tokenizer it was trained with")
    return tokenizer


def inference_config(arguments: InferenceArguments, checkpoint: SavedCheckpoint,
                     params_dtype: torch.dtype | None = None) -> InferenceConfig:
    """The checked InferenceConfig of these arguments and this checkpoint. The model is the
    checkpoint's for inference: no dropout, sdpa attention, no activation checkpointing, no sequence
    parallelism (decoding steps one position at a time); tensors built directly on the device
    (their values are overwritten on load)."""
    flags = arguments.flags
    check_model_flags(arguments, checkpoint)
    seq_length = checked_seq_length(flags, checkpoint)
    model = gpt_model_config(checkpoint, hidden_dropout=0.0, attention_dropout=0.0, attention_impl="sdpa",
                             checkpoint_activations=False, sequence_parallel=False, tp_comm_overlap=False,
                             use_cpu_initialization=False, seq_length=seq_length, **model_dtype(flags, params_dtype))
    parallel = process_layout(arguments, checkpoint)
    try:
        model.validate_for_tensor_parallel(parallel.tensor_model_parallel_size)
    except ValueError as error:
        raise InferenceSetupError(str(error)) from None
    return InferenceConfig(model=model, parallel=parallel, tokenizer=tokenizer_config_from_args(flags),
                           load=flags.load, seq_length=seq_length, seed=flags.seed,
                           micro_batch_size=flags.micro_batch_size)


def load_inference_model(arguments: InferenceArguments, *, params_dtype: torch.dtype | None = None) -> InferenceModel:
    """Check the arguments against the checkpoint (its InferenceConfig), start the process group,
    build this rank's stage and load its weights (module docstring). Raises InferenceSetupError (or
    the checkpoint reader's / tokenizer's error) before any process group exists when the flags or
    the checkpoint are wrong."""
    flags = arguments.flags
    if not flags.load:
        raise InferenceSetupError("give --load, the checkpoint directory")
    checkpoint = open_checkpoint(flags.load, "--load", allow_missing_manifest=flags.allow_missing_manifest)
    if checkpoint.unverified and rank_in_environment(os.environ) == 0:
        print(checkpoint.unverified, flush=True)
    config = inference_config(arguments, checkpoint, params_dtype)
    return build_inference_model(config, checkpoint, checked_tokenizer(config.tokenizer, checkpoint))


def build_inference_model(config: InferenceConfig, checkpoint: SavedCheckpoint, tokenizer) -> InferenceModel:
    """The model of ``config`` with ``checkpoint``'s weights; collective (starts the process group)."""
    groups = initialize_distributed(config.parallel)
    set_random_seeds(config.seed, groups)  # the stage's throw-away initial values draw from the model-parallel RNG
    device = current_device()
    stage = InferenceStage(config.model, groups, device=device)
    load_stage_weights(stage, checkpoint)
    single_gpu = device.type == "cuda" and groups.pp_size == 1 and groups.tp_size == 1
    forward = PipelineForward(stage, groups, static_cache=single_gpu, cuda_graphs=single_gpu)
    return InferenceModel(config, checkpoint, groups, tokenizer, forward, device)
