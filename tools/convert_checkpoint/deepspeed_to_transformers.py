"""Export a checkpoint as a Hugging Face transformers model (GPT-2, BLOOM, Llama or Qwen2), in safetensors.

    python tools/convert_checkpoint/deepspeed_to_transformers.py --input_folder CKPT[/global_stepN] \\
        --output_folder HF_MODEL

The output loads offline with ``transformers.AutoModelForCausalLM.from_pretrained(HF_MODEL)``:
config.json, one safetensors shard per layer with model.safetensors.index.json (written as the
layers are read, one at a time, whatever TP and PP the checkpoint was saved with), and the
tokenizer files the run named when they still exist: GPT-2's vocab.json and merges.txt (with a
tokenizer_config.json), a tokenizer.json with the tokenizer_config.json and special_tokens_map.json
beside it (--tokenizer-model or --tokenizer-name-or-path), or a SentencePiece model as
tokenizer.model. config.json's bos and eos are the tokenizer's, as the trainer uses them. Which
architecture, and the options refused: megatron.core.checkpoint.transformers_export.
"""
import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron.training.initialize import select_accelerator  # noqa: E402

select_accelerator()  # before anything imports deepspeed: one accelerator choice, no per-process guess

from megatron.core.checkpoint.output import staged_directory, tree_size  # noqa: E402
from megatron.core.checkpoint.reader import CheckpointInputError, iter_full_layers  # noqa: E402
from megatron.core.checkpoint.transformers_export import (LLAMA_CLASS, NotExportableError,  # noqa: E402
                                                          architecture, exported_layer, transformers_config)
from tools.convert_checkpoint.reshape import ALLOW_MISSING_MANIFEST_HELP, open_input, report  # noqa: E402

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SENTENCEPIECE_FILE = "tokenizer.model"


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input_folder", required=True, help="a global_stepN directory (or the --save directory)")
    parser.add_argument("--output_folder", required=True, help="the transformers model directory (must not exist)")
    parser.add_argument("--allow_missing_manifest", action="store_true", help=ALLOW_MISSING_MANIFEST_HELP)
    return parser.parse_args(argv)


def _tokenizer_sources(data: dict) -> dict[str, str]:
    """Exported name -> the file the run's tokenizer flags point at (module docstring)."""
    kind = data.get("tokenizer_type", "GPT2BPETokenizer")
    if kind == "GPT2BPETokenizer":
        return {"vocab.json": data.get("vocab_file"), "merges.txt": data.get("merge_file")}
    path = data.get("tokenizer_model") or data.get("tokenizer_name_or_path")
    if not path or not os.path.exists(path):  # gone, or a name on the Hub rather than a local path
        return {}
    if kind in ("HuggingFaceTokenizer", "PretrainedFromHF"):
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        sources = {name: os.path.join(directory, name) for name in HF_TOKENIZER_FILES + ("vocab.json", "merges.txt")}
        if not os.path.isdir(path):
            sources["tokenizer.json"] = path
        return sources
    return {SENTENCEPIECE_FILE: path}


def copy_tokenizer(saved_config: dict, output: str) -> list[str]:
    """The run's tokenizer files that still exist (module docstring); the names copied."""
    data = saved_config.get("data", {})
    copied = []
    for name, path in _tokenizer_sources(data).items():
        if path and os.path.isfile(path):
            shutil.copyfile(path, os.path.join(output, name))
            copied.append(name)
    if {"vocab.json", "merges.txt"} <= set(copied) and "tokenizer_config.json" not in copied:
        with open(os.path.join(output, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "GPT2Tokenizer", "model_max_length": saved_config.get("model", {}).get(
                "max_position_embeddings", 1024)}, f, indent=1)
    return copied


def _copied_tokenizer(output: str, saved_config: dict):
    """The trainer's tokenizer of the files copied to ``output`` (a tokenizer.json or a SentencePiece
    model), or None."""
    from megatron.core.tokenizer import TokenizerError, build_tokenizer

    kind = saved_config.get("data", {}).get("tokenizer_type", "GPT2BPETokenizer")
    if kind in ("HuggingFaceTokenizer", "PretrainedFromHF"):
        kind, path = "HuggingFaceTokenizer", os.path.join(output, "tokenizer.json")
    else:
        path = os.path.join(output, SENTENCEPIECE_FILE)
    if not os.path.isfile(path):
        return None
    try:
        return build_tokenizer(kind, tokenizer_model=path)
    except TokenizerError:
        return None


def _special_tokens(output: str, saved_config: dict, llama_class: bool) -> tuple[int | None, int | None]:
    """(bos, eos) of the exported tokenizer: GPT-2's <|endoftext|> when its vocab.json is there (for both
    under GPT-2 and BLOOM, as eos for the Llama class; transformers' GPT-2 default, 50256, is not a token
    of a smaller vocabulary); else the trainer's own reading of the copied tokenizer (its bos, and eod
    as eos)."""
    vocab_path = os.path.join(output, "vocab.json")
    if saved_config.get("data", {}).get("tokenizer_type", "GPT2BPETokenizer") == "GPT2BPETokenizer":
        if not os.path.isfile(vocab_path):
            return None, None
        with open(vocab_path) as f:
            end = json.load(f).get("<|endoftext|>")
        return (None if llama_class else end), end
    from megatron.core.tokenizer import bos_of

    tokenizer = _copied_tokenizer(output, saved_config)
    return (None, None) if tokenizer is None else (bos_of(tokenizer), tokenizer.eod)


def write_sentencepiece_config(output: str, saved_config: dict) -> None:
    """A tokenizer_config.json beside a copied SentencePiece model: transformers' LlamaTokenizer with
    the model's bos (added, as the trainer adds it) and eos pieces."""
    tokenizer = _copied_tokenizer(output, saved_config)
    path = os.path.join(output, "tokenizer_config.json")
    if tokenizer is None or not hasattr(tokenizer, "inv_vocab") or os.path.exists(path):
        return
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": tokenizer.bos is not None, "add_eos_token": False,
              "eos_token": tokenizer.inv_vocab[tokenizer.eod]}
    if tokenizer.bos is not None:
        config["bos_token"] = tokenizer.inv_vocab[tokenizer.bos]
    with open(path, "w") as f:
        json.dump(config, f, indent=1)


def set_special_tokens(output: str, vocab_size: int, saved_config: dict, llama_class: bool) -> None:
    """bos_token_id and eos_token_id of config.json (``_special_tokens``), None outside the vocabulary."""
    config_path = os.path.join(output, "config.json")
    bos, eos = _special_tokens(output, saved_config, llama_class)
    with open(config_path) as f:
        config = json.load(f)
    config.update({key: (token if token is not None and token < vocab_size else None)
                   for key, token in (("bos_token_id", bos), ("eos_token_id", eos))})
    with open(config_path, "w") as f:
        json.dump(config, f, indent=1)


def export(arguments) -> str:
    from safetensors.torch import save
    from tqdm import tqdm

    started = time.perf_counter()
    checkpoint = open_input(arguments.input_folder, arguments.allow_missing_manifest)
    try:
        kind = architecture(checkpoint.model)
    except NotExportableError as error:
        raise CheckpointInputError(f"{checkpoint.directory}: {error}") from None
    vocab_size, weight_map, dtype = checkpoint.original_vocab_size, {}, None
    with staged_directory(arguments.output_folder) as staging, \
            tqdm(iter_full_layers(checkpoint), total=checkpoint.model["num_layers"] + 2 + bool(
                checkpoint.model.get("untie_embeddings_and_output_weights")), desc="layers", unit="layer",
                 file=sys.stderr) as layers:
        for layer, state in layers:
            tensors = exported_layer(checkpoint.model, layer, state, vocab_size)
            dtype = dtype or next(iter(tensors.values())).dtype
            shard = f"model-layer{layer:05d}.safetensors"
            with open(os.path.join(staging, shard), "wb") as f:  # Python's write: a refused write names its cause
                f.write(save({name: tensor.contiguous() for name, tensor in tensors.items()}, metadata={"format": "pt"}))
            weight_map.update({name: shard for name in tensors})
        with open(os.path.join(staging, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": tree_size(staging)}, "weight_map": weight_map}, f, indent=1)
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(transformers_config(checkpoint.model, vocab_size, dtype), f, indent=1)
        saved_config = checkpoint.state["args"].get("config", {})
        tokenizer = copy_tokenizer(saved_config, staging)
        if SENTENCEPIECE_FILE in tokenizer:
            write_sentencepiece_config(staging, saved_config)
        set_special_tokens(staging, vocab_size, saved_config, kind in LLAMA_CLASS)
    return (f"{kind} of iteration {checkpoint.iteration} (saved at TP {checkpoint.tp}, PP {checkpoint.pp}) written "
            f"to {arguments.output_folder}: {len(weight_map)} tensors, vocabulary {vocab_size} (padding of "
            f"{checkpoint.model['padded_vocab_size'] - vocab_size} rows dropped), tokenizer files: "
            f"{', '.join(tokenizer) or 'none'}, in {time.perf_counter() - started:.1f} s")


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    return report(lambda: export(arguments))


if __name__ == "__main__":
    sys.exit(main())
