"""Export a checkpoint as a Hugging Face transformers model (GPT-2 or BLOOM), in safetensors.

    python tools/convert_checkpoint/deepspeed_to_transformers.py --input_folder CKPT[/global_stepN] \\
        --output_folder HF_MODEL

The output loads offline with ``transformers.AutoModelForCausalLM.from_pretrained(HF_MODEL)``:
config.json, one safetensors shard per layer with model.safetensors.index.json (written as the
layers are read, one at a time, whatever TP and PP the checkpoint was saved with), and the
tokenizer's vocab.json and merges.txt when the run named them and they still exist. Which
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
from megatron.core.checkpoint.transformers_export import (NotExportableError, architecture,  # noqa: E402
                                                          exported_layer, transformers_config)
from tools.convert_checkpoint.reshape import ALLOW_MISSING_MANIFEST_HELP, open_input, report  # noqa: E402


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input_folder", required=True, help="a global_stepN directory (or the --save directory)")
    parser.add_argument("--output_folder", required=True, help="the transformers model directory (must not exist)")
    parser.add_argument("--allow_missing_manifest", action="store_true", help=ALLOW_MISSING_MANIFEST_HELP)
    return parser.parse_args(argv)


def copy_tokenizer(saved_config: dict, output: str) -> list[str]:
    """The run's GPT-2 BPE files, when it named them and they exist; the names copied."""
    data = saved_config.get("data", {})
    copied = []
    for key, name in (("vocab_file", "vocab.json"), ("merge_file", "merges.txt")):
        path = data.get(key)
        if path and os.path.isfile(path):
            shutil.copyfile(path, os.path.join(output, name))
            copied.append(name)
    if len(copied) == 2:
        with open(os.path.join(output, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "GPT2Tokenizer", "model_max_length": saved_config.get("model", {}).get(
                "max_position_embeddings", 1024)}, f, indent=1)
    return copied


def set_end_of_document(output: str, vocab_size: int) -> None:
    """bos/eos of config.json: the tokenizer's <|endoftext|> when its vocab.json is there, else none
    (transformers' GPT-2 default, 50256, is not a token of a smaller vocabulary)."""
    vocab_path, config_path = os.path.join(output, "vocab.json"), os.path.join(output, "config.json")
    end = None
    if os.path.isfile(vocab_path):
        with open(vocab_path) as f:
            end = json.load(f).get("<|endoftext|>")
    with open(config_path) as f:
        config = json.load(f)
    end = end if end is not None and end < vocab_size else None
    config.update(bos_token_id=end, eos_token_id=end)
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
            tqdm(iter_full_layers(checkpoint), total=checkpoint.model["num_layers"] + 2, desc="layers", unit="layer",
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
        tokenizer = copy_tokenizer(checkpoint.state["args"].get("config", {}), staging)
        set_end_of_document(staging, vocab_size)
    return (f"{kind} of iteration {checkpoint.iteration} (saved at TP {checkpoint.tp}, PP {checkpoint.pp}) written "
            f"to {arguments.output_folder}: {len(weight_map)} tensors, vocabulary {vocab_size} (padding of "
            f"{checkpoint.model['padded_vocab_size'] - vocab_size} rows dropped), tokenizer files: "
            f"{', '.join(tokenizer) or 'none'}, in {time.perf_counter() - started:.1f} s")


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    return report(lambda: export(arguments))


if __name__ == "__main__":
    sys.exit(main())
