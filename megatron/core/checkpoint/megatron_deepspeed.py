"""Checkpoints written by Megatron-DeepSpeed (BigScience's fork) on the DeepSpeed engine: recognised,
read without running its code, and translated into this trainer's state.

What that trainer writes (its megatron/checkpointing.py, ``save_checkpoint`` with --deepspeed):
``engine.save_checkpoint(args.save, client_state=state_dict)`` with DeepSpeed's default tag
``global_step{N}``; DeepSpeed writes the layer files, the ``mp_rank_MM_model_states.pt`` files, the
optimizer partitions and ``latest``. There is no manifest and, in that mode, no
``latest_checkpointed_iteration.txt``. The client state in every mp_rank file:

    args                 its argparse.Namespace, pickled whole. The counters live here:
                         consumed_train_samples, consumed_valid_samples, consumed_train_tokens,
                         gigaflos_no_embeds, curriculum_seqlen (with curriculum learning); the model
                         (num_layers, hidden_size, ..., position_embedding_type as its own enum
                         megatron.enums.PositionEmbeddingType) and the layout
                         (tensor/pipeline_model_parallel_size, data_parallel_size)
    checkpoint_version   3.0
    iteration, tokens    iterations done, consumed_train_tokens
    checkpoint_info      padded_vocab_size, original_vocab_size
    random_rng_state, np_rng_state, torch_rng_state, cuda_rng_state, rng_tracker_states
                         unless --no-save-rng; the tracker's states are CUDA generator states only

DeepSpeed's own entries sit beside them (``lr_scheduler`` is AnnealingLR's eight keys, read as
they are by megatron.training.lr_schedule). Its optimizer has three parameter groups: the
weight-decay parameters split in two halves (a workaround for apex's FusedAdam), then the biases and
norm weights, where this trainer has two; the ZeRO partitions' ``param_slice_mappings`` name every
parameter's fragment, so the states are moved by name (``parameter_states``), whatever the groups.
At ZeRO stage 0 (fp32) the torch optimizer state in the model-states files numbers the parameters
in group order: merging its groups gives ours (``own_optimizer_state``). A universal conversion reads
such a checkpoint through ``translated_input`` and gives its groups our shape too.

Parameter names are this trainer's, layer for layer (docs/checkpoint-format.md), except the
embedding LayerNorm (--embed-layernorm), which Megatron-DeepSpeed keeps inside the word embedding:
``word_embeddings.norm.*`` there, ``embed_layernorm.*`` here (names.own_name), and builds on the first
pipeline stage only.

Reading: the ``args`` entry is a pickled Namespace holding Megatron-DeepSpeed's enums (and,
possibly, other objects of its code, such as a curriculum scheduler), so a plain ``torch.load``
needs that code importable and would run whatever the pickle names. ``load_file`` unpickles
through an allow-list instead: tensors, numpy arrays, the containers, torch dtypes and sizes;
argparse.Namespace becomes SavedArguments (attributes read with getattr); Megatron-DeepSpeed's enums
become their member names; any other class becomes an inert ForeignObject that records what the
pickle gave it and runs nothing.
"""
import contextlib
import dataclasses
import glob
import os
import pickle
import re
import shutil
import tempfile
import types

import torch

from megatron.core.checkpoint.names import own_name
from megatron.core.checkpoint.origin import WRITER_KEY
from megatron.core.checkpoint.reader import CheckpointInputError
from megatron.core.models.gpt.config import GPTModelConfig

WRITER = "Megatron-DeepSpeed"
MODEL_STATES_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
PARTITION_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
ADAM_STATES = ("exp_avg", "exp_avg_sq")
TIED_EMBEDDING_LAYERNORM = "tied_modules.embed.embed_layernorm."  # ours; first pipeline stage only in theirs
# Megatron-DeepSpeed's enums (megatron/enums.py): value -> member name.
FOREIGN_ENUMS = {
    "PositionEmbeddingType": {1: "rotary", 2: "absolute", 3: "alibi"},
    "AttnMaskType": {1: "padding", 2: "causal", 3: "prefix", 4: "custom"},
    "LayerType": {1: "encoder", 2: "decoder"},
    "AttnType": {1: "self_attn", 2: "cross_attn"},
}
_ALLOWED = {
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
    ("builtins", "complex"), ("builtins", "bytearray"), ("_codecs", "encode"),
    ("torch", "Size"), ("torch", "device"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"), ("torch._tensor", "_rebuild_from_type_v2"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
}


class MegatronDeepSpeedError(CheckpointInputError):
    """A Megatron-DeepSpeed checkpoint that cannot be read or continued; the message names the file."""


class SavedArguments(types.SimpleNamespace):
    """Megatron-DeepSpeed's pickled argparse.Namespace: its attributes, read with getattr."""


class ForeignObject:
    """An object of a class outside the allow-list: what the pickle gave it (``arguments`` of its
    construction, ``state``, items), kept as data. ``cls_name`` is "module.name"."""

    cls_name = "?"

    def __init__(self, *arguments, **keywords):
        self.arguments, self.keywords = arguments, keywords

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    def __setitem__(self, key, value):
        self.__dict__.setdefault("items", {})[key] = value

    def append(self, value):
        self.__dict__.setdefault("elements", []).append(value)

    def extend(self, values):
        self.__dict__.setdefault("elements", []).extend(values)

    def __repr__(self):
        return f"<{self.cls_name} from a checkpoint, not loaded>"


def _foreign_class(module: str, name: str) -> type:
    return type(name, (ForeignObject,), {"cls_name": f"{module}.{name}"})


def _foreign_enum(members: dict[int, str]):
    """Megatron-DeepSpeed's enum classes: calling one with a value (how an Enum unpickles) gives the member's name."""
    def member(value):
        return members.get(value, f"unknown ({value})")
    return member


class _RestrictedUnpickler(pickle.Unpickler):
    """The allow-list of the module docstring."""

    def find_class(self, module, name):
        module = "builtins" if module == "__builtin__" else module
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "argparse" and name == "Namespace":
            return SavedArguments
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module.startswith("numpy.dtypes") or module == "numpy") and name.endswith("DType"):
            return super().find_class(module, name)
        if module == "megatron.enums" and name in FOREIGN_ENUMS:
            return _foreign_enum(FOREIGN_ENUMS[name])
        return _foreign_class(module, name)


restricted_pickle = types.SimpleNamespace(Unpickler=_RestrictedUnpickler, load=pickle.load,
                                          __name__="restricted_pickle")


def load_file(path: str, mmap: bool = True) -> dict:
    """A checkpoint file unpickled through the allow-list (module docstring), tensors on the CPU."""
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=False, pickle_module=restricted_pickle, mmap=mmap)
        except RuntimeError:
            if not mmap:
                raise
            # a file in the legacy (non-zip) format cannot be memory-mapped
            return torch.load(path, map_location="cpu", weights_only=False, pickle_module=restricted_pickle)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as error:
        raise MegatronDeepSpeedError(f"cannot read {path} ({type(error).__name__}: {error})") from None


def is_megatron_deepspeed_state(state) -> bool:
    """``state`` (a model-states file read by load_file) is Megatron-DeepSpeed's: its ``args`` is its Namespace."""
    return isinstance(state, dict) and isinstance(state.get("args"), SavedArguments) and "iteration" in state


def is_translated(state) -> bool:
    """``state`` is the translation of a Megatron-DeepSpeed model-states file (``trainer_state``)."""
    return isinstance(state, dict) and state.get(WRITER_KEY) == WRITER


def model_states_files(directory: str) -> list[str]:
    found = sorted((int(m[1]), name) for name in os.listdir(directory) if (m := MODEL_STATES_FILE.match(name)))
    return [os.path.join(directory, name) for _, name in found]


def read_checkpoint_state(directory: str) -> dict | None:
    """The translated state (``trainer_state``) of the first model-states file of tag ``directory``
    when Megatron-DeepSpeed wrote it; None when another trainer did."""
    files = model_states_files(directory)
    if not files:
        return None
    state = load_file(files[0])
    return trainer_state(state, files[0]) if is_megatron_deepspeed_state(state) else None


def plain(value):
    """A value of the pickled args as plain data: enum members are already names, dtypes become
    their str, a ForeignObject its class name."""
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, ForeignObject):
        return value.cls_name
    return str(value)


def llama_class_options(arguments: SavedArguments) -> list[str]:
    """The Llama-class options of Microsoft's Megatron-DeepSpeed that the args set (as its flags), whose
    names and weight layouts BigScience's fork, the one read here, does not have."""
    options = [flag for flag, name in (("--swiglu", "swiglu"), ("--use-rotary-position-embeddings",
                                                                 "use_rotary_position_embeddings"),
                                       ("--untie-embeddings-and-output-weights", "untie_embeddings_and_output_weights"))
               if getattr(arguments, name, False)]
    heads, groups = getattr(arguments, "num_attention_heads", None), getattr(arguments, "num_key_value_heads", None)
    if groups not in (None, heads):
        options.append(f"--num-key-value-heads {groups}")
    if str(getattr(arguments, "normalization", "layernorm")).lower() != "layernorm":
        options.append(f"--normalization {arguments.normalization}")
    if not getattr(arguments, "add_bias_linear", True):
        options.append("--disable-bias-linear")
    return options


# fields not taken from Megatron-DeepSpeed's args: the dtype (from the weights), and FP8's, which its
# fork never trained with (Megatron-LM-style defaults there would ask for layers kept out of FP8)
_NOT_READ_FIELDS = ("params_dtype", "fp8", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")


def model_fields(arguments: SavedArguments, source: str = "the checkpoint") -> dict:
    """Our model configuration's fields that Megatron-DeepSpeed's args hold under the same name
    (num_layers, hidden_size, ..., position_embedding_type as "absolute" / "rotary" / "alibi"); a
    model with Llama-class options (``llama_class_options``) is refused, naming them."""
    options = llama_class_options(arguments)
    if options:
        raise MegatronDeepSpeedError(f"{source}: a Megatron-DeepSpeed model with {', '.join(options)} is not read "
                                     f"here; export it to a Hugging Face Llama directory and import that with "
                                     f"tools/convert_checkpoint/transformers_to_megatron.py")
    fields = [field.name for field in dataclasses.fields(GPTModelConfig) if field.name not in _NOT_READ_FIELDS]
    # an option Megatron-DeepSpeed left unset (None, e.g. Megatron-LM's recompute flags in Microsoft's
    # fork) takes our default
    values = {name: plain(getattr(arguments, name)) for name in fields if getattr(arguments, name, None) is not None}
    if "normalization" in values:  # Microsoft's fork spells it "layernorm", the only one read
        values["normalization"] = "LayerNorm"
    return values


def progress_entries(state: dict) -> dict:
    """The counters, under this trainer's client-state keys: iteration from the state, the consumed
    samples and FLOPs from ``args``, the tokens from ``tokens`` (args' own copy otherwise)."""
    arguments = state["args"]
    curriculum = getattr(arguments, "curriculum_learning", False)
    return {"iteration": int(state["iteration"]),
            "consumed_train_samples": int(getattr(arguments, "consumed_train_samples", 0)),
            "consumed_valid_samples": int(getattr(arguments, "consumed_valid_samples", 0)),
            "consumed_train_tokens": int(state.get("tokens", getattr(arguments, "consumed_train_tokens", 0))),
            "gigaflos_no_embeddings": float(getattr(arguments, "gigaflos_no_embeds", 0.0)),
            "curriculum_seqlen": getattr(arguments, "curriculum_seqlen", None) if curriculum else None}


def trainer_state(state: dict, source: str = "the checkpoint") -> dict:
    """A Megatron-DeepSpeed model-states dict in this trainer's terms: ``args`` as plain values
    (``model``, the TP / PP / DP sizes, and the whole Namespace under ``megatron_deepspeed_args``),
    the counters under our keys (progress_entries), WRITER_KEY set; the rest as saved."""
    arguments = state["args"]
    translated = dict(state)
    translated["args"] = {
        "model": model_fields(arguments, source),
        "tensor_model_parallel_size": getattr(arguments, "tensor_model_parallel_size", 1),
        "pipeline_model_parallel_size": getattr(arguments, "pipeline_model_parallel_size", 1),
        "data_parallel_size": getattr(arguments, "data_parallel_size", state.get("dp_world_size")),
        "megatron_deepspeed_args": plain(vars(arguments)),
    }
    translated.update(progress_entries(state))
    translated[WRITER_KEY] = WRITER
    return translated


def own_layer_state(state: dict) -> dict:
    """A layer file's state dict with our key names."""
    return type(state)((own_name(key), value) for key, value in state.items()) if isinstance(state, dict) else state


def parameter_states(directory: str, model_parallel_rank: int) -> tuple[dict[str, dict[str, torch.Tensor]], object]:
    """({our parameter name: {"fp32", "exp_avg", "exp_avg_sq": its whole tensor on this TP rank}}, Adam's
    step) from the ZeRO partitions of model-parallel rank ``model_parallel_rank`` (all DP ranks: each
    holds a fragment), by the partitions' ``param_slice_mappings`` and the model-states file's
    ``param_shapes``. Tensors are memory-mapped: only what is used is read."""
    paths = sorted(((int(m[1]), os.path.join(directory, name)) for name in os.listdir(directory)
                    if (m := PARTITION_FILE.match(name)) and int(m[2]) == model_parallel_rank))
    if not paths:
        raise MegatronDeepSpeedError(f"{directory}: no ZeRO optimizer partition of model-parallel rank "
                                     f"{model_parallel_rank} (*zero_pp_rank_*_mp_rank_{model_parallel_rank:02d}_"
                                     f"optim_states.pt): resume with --no-load-optim")
    shapes_file = os.path.join(directory, f"mp_rank_{model_parallel_rank:02d}_model_states.pt")
    shapes = load_file(shapes_file).get("param_shapes")
    partitions = [_optimizer_state(path) for _, path in paths]
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
    group_of: dict[str, int] = {}
    for optimizer in partitions:
        for group, fragments in enumerate(optimizer["param_slice_mappings"]):
            flat = {"fp32": optimizer["single_partition_of_fp32_groups"][group],
                    **{key: optimizer["base_optimizer_state"]["state"][group][key] for key in ADAM_STATES}}
            for name, fragment in fragments.items():
                group_of[name] = group
                for key, tensor in flat.items():
                    pieces.setdefault(name, {}).setdefault(key, []).append(
                        tensor.narrow(0, int(fragment.start), int(fragment.numel)))
    if not shapes:
        raise MegatronDeepSpeedError(f"{shapes_file} has no param_shapes: not a ZeRO checkpoint")
    states = {own_name(name): {key: torch.cat(parts).view(shapes[group_of[name]][name])
                               for key, parts in by_key.items()}
              for name, by_key in pieces.items()}
    step = partitions[0]["base_optimizer_state"]["state"][0].get("step")
    return states, step


def _optimizer_state(path: str) -> dict:
    state = load_file(path)
    optimizer = state.get("optimizer_state_dict") if isinstance(state, dict) else None
    if not isinstance(optimizer, dict) or "param_slice_mappings" not in optimizer:
        raise MegatronDeepSpeedError(f"{path} holds no param_slice_mappings (a ZeRO-1 checkpoint of a DeepSpeed "
                                     f"older than its bf16 optimizer): its optimizer states cannot be matched to "
                                     f"parameters; resume with --no-load-optim")
    return optimizer


def has_optimizer_partitions(directory: str) -> bool:
    return bool(glob.glob(os.path.join(directory, "*zero_pp_rank_*_optim_states.pt")))


@contextlib.contextmanager
def translated_input(tag_directory: str, scratch_parent: str):
    """Yields ``tag_directory`` itself unless Megatron-DeepSpeed wrote it; then a temporary directory
    under ``scratch_parent`` (removed after) that links to its files but holds its model-states files
    translated (``trainer_state``, torch.save), so a reader of this trainer's checkpoints reads it."""
    files = model_states_files(tag_directory) if os.path.isdir(tag_directory) else []
    if not files or not is_megatron_deepspeed_state(load_file(files[0])):
        yield tag_directory
        return
    view = tempfile.mkdtemp(prefix=".megatron-deepspeed-", dir=scratch_parent)
    try:
        for name in os.listdir(tag_directory):
            source = os.path.abspath(os.path.join(tag_directory, name))
            if MODEL_STATES_FILE.match(name):
                torch.save(trainer_state(load_file(source, mmap=False), source), os.path.join(view, name))
            else:
                os.symlink(source, os.path.join(view, name))
        yield view
    finally:
        shutil.rmtree(view, ignore_errors=True)


def merge_parameter_groups(groups: list[dict]) -> list[dict]:
    """Consecutive optimizer parameter groups with equal settings made one: Megatron-DeepSpeed's three
    (weight decay, weight decay, none) become this trainer's two, whose settings a universal
    checkpoint's loader pairs with ours group by group."""
    merged: list[dict] = []
    for group in groups:
        settings = {key: value for key, value in group.items() if key != "params"}
        previous = merged[-1] if merged else None
        if previous is not None and {key: value for key, value in previous.items() if key != "params"} == settings:
            previous["params"] = list(previous.get("params", [])) + list(group.get("params", []))
        else:
            merged.append(dict(group))
    return merged


def own_optimizer_state(optimizer, path: str):
    """The torch optimizer state dict of a model-states file (ZeRO stage 0; ``path``) with our
    parameter groups: its parameters are numbered in group order, which merging consecutive groups
    keeps (merge_parameter_groups). None stays None; another format (DeepSpeed's fp16 optimizer,
    whose flat fp32 groups differ from ours) is refused."""
    if optimizer is None:
        return None
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("param_groups"), list) \
            or "state" not in optimizer:
        raise MegatronDeepSpeedError(f"{path}: its optimizer state is not a torch optimizer's (fp16 at ZeRO stage "
                                     f"0?), whose parameter groups could be matched to ours: resume with "
                                     f"--no-load-optim")
    return {**optimizer, "param_groups": merge_parameter_groups(optimizer["param_groups"])}


def rename_universal_parameters(zero_directory: str) -> None:
    """The parameter folders of a universal checkpoint's ``zero/`` under our names (own_name)."""
    for name in os.listdir(zero_directory):
        if own_name(name) != name:
            os.replace(os.path.join(zero_directory, name), os.path.join(zero_directory, own_name(name)))
