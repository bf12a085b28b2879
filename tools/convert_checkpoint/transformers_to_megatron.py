"""Import a transformers GPT-2, BLOOM, Llama, Mistral or Qwen2 model as a checkpoint at any TP and PP size.

    python tools/convert_checkpoint/transformers_to_megatron.py --input_folder HF_MODEL \\
        --output_folder CKPT --target_tp 2 --target_pp 2 [--pad_vocab_size_to P] [--seq_length S]

HF_MODEL is a local transformers directory (config.json and safetensors or pytorch_model.bin
weights). CKPT is a --save directory: ``global_step0`` in the pipeline engine's layout, weights
only, with the model configuration, a manifest and ``latest``; the tokenizer files found in
HF_MODEL are copied to CKPT/tokenizer (GPT-2's vocab.json and merges.txt, else a tokenizer.json,
else a SentencePiece tokenizer.model; a Llama-class model's tokenizer.json first). The summary
prints the flags a run needs to load it:

    pretrain_gpt.py <those model flags> --load CKPT --no-load-optim --no-load-rng ...    (or --finetune)

The vocabulary: the word embeddings (and an untied output layer) keep the model's rows and gain zero
rows up to a multiple of the target TP size, or up to --pad_vocab_size_to. A zero row's logit is 0
and enters the softmax, so with padding the loss is no longer exactly transformers'; the summary
reports the rows added.
Which configurations import, and how the tensors map: megatron.core.checkpoint.transformers_import.
"""
import argparse
import dataclasses
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.training.initialize import select_accelerator  # noqa: E402

select_accelerator()  # before anything imports deepspeed: one accelerator choice, no per-process guess

from megatron.core.checkpoint.reader import CheckpointInputError  # noqa: E402
from megatron.core.checkpoint.sharding import ModelSharding  # noqa: E402
from megatron.core.checkpoint.transformers_import import (BLOOM, LLAMA_CLASS, TransformersWeights,  # noqa: E402
                                                          imported_layers, model_options, read_transformers_config)
from megatron.core.checkpoint.writer import check_target_layout, write_checkpoint  # noqa: E402
from megatron.core.models.gpt.config import GPTConfigError, GPTModelConfig  # noqa: E402
from tools.convert_checkpoint.reshape import layout_parser, report  # noqa: E402

TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model")
TOKENIZER_DIRECTORY = "tokenizer"
BLOOM_SEQ_LENGTH = 2048


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = layout_parser(__doc__.split("\n")[0], "a local transformers model directory",
                           "the new --save directory (must not exist)")
    parser.add_argument("--pad_vocab_size_to", type=int, default=None,
                        help="rows of the word embeddings (default: the model's, up to a multiple of --target_tp)")
    parser.add_argument("--seq_length", type=int, default=None,
                        help=f"training sequence length (default: the model's max_position_embeddings, GPT-2's "
                             f"n_positions; BLOOM {BLOOM_SEQ_LENGTH})")
    return parser.parse_args(argv)


def padded_vocabulary(vocab_size: int, tp: int, requested: int | None) -> int:
    if requested is None:
        return -(-vocab_size // tp) * tp
    if requested < vocab_size or requested % tp:
        raise CheckpointInputError(f"--pad_vocab_size_to {requested}: must be at least the model's {vocab_size} "
                                   f"rows and a multiple of --target_tp {tp}")
    return requested


def model_config(options: dict, seq_length: int, padded: int, dtype: torch.dtype) -> GPTModelConfig:
    """The GPTModelConfig of the imported options (GPTModelConfig fields; BLOOM's missing position table
    counts the training length)."""
    fields = {field.name for field in dataclasses.fields(GPTModelConfig)}
    values = {name: value for name, value in options.items() if name in fields}
    values["max_position_embeddings"] = options["max_position_embeddings"] or seq_length
    try:
        return GPTModelConfig(**values, padded_vocab_size=padded, seq_length=seq_length, params_dtype=dtype)
    except GPTConfigError as error:
        raise CheckpointInputError(f"the imported model cannot be configured: {error}") from None


def model_flags(model: GPTModelConfig) -> list[str]:
    """The trainer's flags for ``model``: the fields a load checks, the activation, the norm and its epsilon,
    the rotary settings."""
    flags = ["--num-layers", model.num_layers, "--hidden-size", model.hidden_size,
             "--num-attention-heads", model.num_attention_heads, "--ffn-hidden-size", model.ffn_hidden_size,
             "--seq-length", model.seq_length, "--max-position-embeddings", model.max_position_embeddings,
             "--position-embedding-type", model.position_embedding_type,
             "--layernorm-epsilon", model.layernorm_epsilon, "--pad-vocab-size-to", model.padded_vocab_size]
    if model.padded_vocab_size % 128:  # the default --make-vocab-size-divisible-by must divide it
        flags += ["--make-vocab-size-divisible-by", 1]
    if model.glu_activation == "swiglu":
        flags.append("--swiglu")
    else:
        flags.append("--openai-gelu" if model.openai_gelu else "--no-bias-gelu-fusion")
    flags += ["--embed-layernorm"] * model.embed_layernorm
    flags += ["--apply-residual-connection-post-layernorm"] * model.apply_residual_connection_post_layernorm
    return [str(flag) for flag in flags + _llama_flags(model)]


def _llama_flags(model: GPTModelConfig) -> list:
    """The flags of the Llama-class options that differ from the defaults."""
    flags = []
    if model.normalization != "LayerNorm":
        flags += ["--normalization", model.normalization]
    if model.kv_channels * model.num_attention_heads != model.hidden_size:
        flags += ["--kv-channels", model.kv_channels]
    if model.num_query_groups != model.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", model.num_query_groups]
    if model.position_embedding_type == "rotary":
        flags += ["--rotary-base", f"{model.rotary_base:g}"]
        flags += ["--rotary-percent", model.rotary_percent] * (model.rotary_percent != 1.0)
    if model.use_rope_scaling:
        flags += ["--use-rope-scaling", "--rope-scaling-factor", model.rope_scaling_factor,
                  "--rope-scaling-low-freq-factor", model.rope_scaling_low_freq_factor,
                  "--rope-scaling-high-freq-factor", model.rope_scaling_high_freq_factor,
                  "--rope-scaling-original-max-position-embeddings",
                  model.rope_scaling_original_max_position_embeddings]
    flags += ["--untie-embeddings-and-output-weights"] * model.untie_embeddings_and_output_weights
    flags += ["--disable-bias-linear"] * (not model.add_bias_linear)
    flags += ["--add-qkv-bias"] * (model.add_qkv_bias and not model.add_bias_linear)
    return flags


def tokenizer_settings(source: str, output: str, llama_class: bool = False) -> tuple[list[str], dict]:
    """(the trainer's flags, the recorded data settings) for the tokenizer files copy_tokenizer_files
    puts under ``output``: for GPT-2 and BLOOM the GPT-2 BPE files, else a tokenizer.json
    (HuggingFaceTokenizer), else a SentencePiece tokenizer.model; for the Llama class the
    tokenizer.json first (Qwen2 ships vocab.json and merges.txt too, but splits text otherwise than
    GPT-2's BPE). None of them: no flags."""
    present = {name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(source, name))}
    directory = os.path.join(output, TOKENIZER_DIRECTORY)
    gpt2_files = {"vocab.json", "merges.txt"} <= present
    if gpt2_files and not (llama_class and "tokenizer.json" in present):
        vocab, merges = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
        return (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges],
                {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab, "merge_file": merges})
    if "tokenizer.json" in present:
        return (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", directory],
                {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": directory})
    if "tokenizer.model" in present:
        model = os.path.join(directory, "tokenizer.model")
        return (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model],
                {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": model})
    return [], {}


def copy_tokenizer_files(source: str, staging: str) -> None:
    names = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(source, name))]
    if names:
        os.makedirs(os.path.join(staging, TOKENIZER_DIRECTORY))
    for name in names:
        shutil.copyfile(os.path.join(source, name), os.path.join(staging, TOKENIZER_DIRECTORY, name))


def import_model(arguments) -> str:
    from tqdm import tqdm

    from megatron.core.checkpoint.client_state import imported_checkpoint_state
    from megatron.training.engine.checkpoint_io import deepspeed_version

    started = time.perf_counter()
    source, tp, pp = arguments.input_folder, arguments.target_tp, arguments.target_pp
    kind, options = model_options(read_transformers_config(source), source, arguments.seq_length)
    check_target_layout(options, tp, pp)
    weights = TransformersWeights(source)
    vocab_size = options["vocab_size"]
    padded = padded_vocabulary(vocab_size, tp, arguments.pad_vocab_size_to)
    seq_length = arguments.seq_length or options["max_position_embeddings"] or BLOOM_SEQ_LENGTH
    model = model_config(options, seq_length, padded, weights.dtype)
    output = os.path.abspath(arguments.output_folder)
    tokenizer_flags, data = tokenizer_settings(source, output, kind in LLAMA_CLASS)
    state = imported_checkpoint_state(model, vocab_size, tp, pp, {**data, "orig_vocab_size": vocab_size},
                                      deepspeed_version())
    layers_total = options["num_layers"] + 2 + bool(options.get("untie_embeddings_and_output_weights"))
    with tqdm(imported_layers(weights, kind, options, padded), total=layers_total, desc="layers",
              unit="layer", file=sys.stderr) as layers:
        written = write_checkpoint(output, 0, layers, state, tp, pp, ModelSharding(model),
                                   before_commit=lambda staging: copy_tokenizer_files(source, staging))
    padding = (f"padded to {padded} rows ({padded - vocab_size} zero rows, whose logits 0 enter the softmax)"
               if padded > vocab_size else "not padded")
    return (f"{kind} from {source} written at TP {tp}, PP {pp} to {output}/global_step0: {written} layers in "
            f"{time.perf_counter() - started:.1f} s; vocabulary of {vocab_size} rows {padding}. Train it with: "
            f"{' '.join(model_flags(model) + tokenizer_flags)} --tensor-model-parallel-size {tp} "
            f"--pipeline-model-parallel-size {pp} --load {output} --no-load-optim --no-load-rng (or --finetune)"
            + (f"; BLOOM has no position table: --seq_length chooses the length ({seq_length} here)"
               if kind == BLOOM and arguments.seq_length is None else ""))


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    return report(lambda: import_model(arguments))


if __name__ == "__main__":
    sys.exit(main())
