"""Checkpoints through the DeepSpeed engine, in Megatron-DeepSpeed's layout, plus the trainer's state.

The files, their keys and the commit protocol are described in docs/checkpoint-format.md.

``engine.save_checkpoint(save, tag="global_step{N}", client_state=...)`` writes the module (one
``layer_XX-model_TT-model_states.pt`` per pipeline layer, or the whole module for the plain
engine), the optimizer partitions and ``mp_rank_MM_model_states.pt`` with the engine's own entries
(the LR schedule under ``lr_scheduler``, skipped steps, global steps and samples), to which the
client state adds:

    iteration, consumed_train_samples, consumed_train_tokens, consumed_valid_samples,
    gigaflos_no_embeddings, tokens (= consumed_train_tokens, Megatron-DeepSpeed's key), checkpoint_version
    3.0, checkpoint_info {padded_vocab_size, original_vocab_size}, args (the model, the layout and the
    whole typed configuration, as plain values), and
    unless --no-save-rng the RNG states: random_rng_state, np_rng_state, torch_rng_state,
    cuda_rng_state, rng_tracker_states.

Commit: only once every rank has written its files does rank 0 point ``latest`` ("global_stepN")
at the new tag, and then Megatron's ``latest_checkpointed_iteration.txt`` ("N", which
Megatron-DeepSpeed only wrote in its conversion tools); each is replaced atomically. DeepSpeed itself lets rank 0 write
``latest`` as soon as its own files are done, so a job killed while another rank was still writing
pointed the next run at a partial checkpoint. Killed at any moment of a save, a run now resumes from
the previous complete checkpoint.

Loading (--load) takes ``latest``; a missing or empty directory means a start from scratch, with a
warning. Before DeepSpeed reads anything, the checkpoint must match the run: written by this trainer,
the same model, the same engine kind, the same TP and PP sizes, the same DP size when ZeRO partitioned the optimizer states (unless
--no-load-optim), and every layer file of this stage present; a file that cannot be read is named.
Each refusal is a CheckpointError. What is restored:

    default            weights, optimizer, LR schedule, counters (iteration, samples, tokens,
                       validation samples: the data position), RNG states
    --no-load-optim    no optimizer state (ZeRO rebuilds its fp32 copy from the weights); the LR
                       schedule and the counters are restored, so the run continues on schedule
    --no-load-rng      RNG states left as seeded
    --finetune         weights, and the optimizer unless --no-load-optim (as Megatron-DeepSpeed with
                       DeepSpeed); the LR schedule, counters and RNG start afresh at iteration 0
"""
import contextlib
import dataclasses
import glob
import os
import pickle
import random
from dataclasses import dataclass

import numpy as np
import torch

from megatron.core.tensor_parallel import get_rng_tracker
from megatron.training.config import CheckpointConfig, TrainConfig, plain_value
from megatron.training.dist_utils import barrier, is_rank_0, print_rank_0
from megatron.training.engine import is_pipeline_engine
from megatron.training.metrics import loaded_checkpoint_line, saved_checkpoint_line, saving_checkpoint_line

CHECKPOINT_VERSION = 3.0
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
LATEST_FILENAME = "latest"  # DeepSpeed's name; engine.load_checkpoint reads it
# Model fields whose change between save and load is an error (not a shape mismatch DeepSpeed reports).
CHECKED_MODEL_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels",
                        "padded_vocab_size", "position_embedding_type", "max_position_embeddings",
                        "glu_activation", "embed_layernorm", "apply_residual_connection_post_layernorm")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed with this configuration; the message names the flags."""


@dataclass
class TrainingProgress:
    """Where training stands; saved in every checkpoint and restored on --load."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_train_tokens: int = 0
    consumed_valid_samples: int = 0
    gigaflos_no_embeddings: float = 0.0


def checkpoint_tag(iteration: int) -> str:
    return f"global_step{iteration}"


def configuration_summary(config: TrainConfig) -> dict:
    """The ``args`` entry: the model config and the parallel layout at the top (what loading checks),
    and the whole configuration under ``config``, all as plain values."""
    return {"model": plain_value(config.model),
            "tensor_model_parallel_size": config.parallel.tensor_model_parallel_size,
            "pipeline_model_parallel_size": config.parallel.pipeline_model_parallel_size,
            "data_parallel_size": config.parallel.data_parallel_size,
            "config": plain_value(config)}


def rng_states() -> dict:
    """Megatron-DeepSpeed's five RNG entries of the client state."""
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "rng_tracker_states": get_rng_tracker().get_states()}


def restore_rng_states(state: dict) -> None:
    missing = [key for key in ("random_rng_state", "np_rng_state", "torch_rng_state", "rng_tracker_states")
               if key not in state]
    if missing:
        raise CheckpointError(f"the checkpoint holds no RNG states ({', '.join(missing)} missing; saved with "
                              f"--no-save-rng?): resume with --no-load-rng")
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and state.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    get_rng_tracker().set_states(state["rng_tracker_states"])


def client_state(progress: TrainingProgress, config: TrainConfig) -> dict:
    """What the trainer adds to DeepSpeed's mp_rank file (module docstring)."""
    state = dataclasses.asdict(progress)
    state.update(tokens=progress.consumed_train_tokens, checkpoint_version=CHECKPOINT_VERSION,
                 checkpoint_info={"padded_vocab_size": config.model.padded_vocab_size,
                                  "original_vocab_size": config.data.orig_vocab_size},
                 args=configuration_summary(config))
    if not config.checkpoint.no_save_rng:
        state.update(rng_states())
    return state


def _replace_file(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old content or the new, never a part."""
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def _commit(directory: str, iteration: int) -> None:
    _replace_file(os.path.join(directory, LATEST_FILENAME), checkpoint_tag(iteration))
    _replace_file(os.path.join(directory, TRACKER_FILENAME), f"{iteration}\n")


def save_checkpoint(engine, progress: TrainingProgress, config: TrainConfig) -> None:
    """Collective: every rank writes its part through the engine; rank 0 then commits (module docstring)."""
    directory = config.checkpoint.save
    print_rank_0(saving_checkpoint_line(progress.iteration, directory))
    engine.save_checkpoint(directory, tag=checkpoint_tag(progress.iteration),
                           client_state=client_state(progress, config), save_latest=False)
    barrier()
    if is_rank_0():
        _commit(directory, progress.iteration)
    barrier()
    print_rank_0(saved_checkpoint_line(progress.iteration, directory))


def _check_compatible(state: dict, config: TrainConfig, directory: str) -> None:
    if state.get("checkpoint_version") is None or "iteration" not in state:
        raise CheckpointError(f"{directory}: the checkpoint has no trainer state (checkpoint_version, iteration); "
                              f"it was not written by this trainer")
    saved = state.get("args", {}).get("model", {})
    configured = plain_value(config.model)
    differing = [f"--{name.replace('_', '-')}: checkpoint {saved[name]!r}, configured {configured[name]!r}"
                 for name in CHECKED_MODEL_FIELDS if name in saved and saved[name] != configured[name]]
    if differing:
        raise CheckpointError(f"{directory}: the checkpoint's model differs from the configured one: "
                              + "; ".join(differing))


def _tag_directory(directory: str) -> str | None:
    """The directory ``latest`` names; None without a ``latest`` file (nothing to load)."""
    latest = os.path.join(directory, LATEST_FILENAME)
    if not os.path.isfile(latest):
        return None
    with open(latest) as f:
        tag_directory = os.path.join(directory, f.read().strip())
    if not os.path.isdir(tag_directory):
        raise CheckpointError(f"{latest} names {tag_directory}, which does not exist")
    return tag_directory


def _earlier_tag_advice(tag_directory: str) -> str:
    return f"point {os.path.join(os.path.dirname(tag_directory), LATEST_FILENAME)} at an earlier global_stepN"


def _check_engine_layout(engine, tag_directory: str) -> None:
    """A pipeline engine's checkpoint keeps the module in layer_XX files, the plain engine's in
    mp_rank_XX; neither engine reads the other's. Name the cause rather than fail inside DeepSpeed."""
    saved_by_pipeline = any(name.startswith("layer_") for name in os.listdir(tag_directory))
    loading_with_pipeline = is_pipeline_engine(engine)
    if saved_by_pipeline != loading_with_pipeline:
        engines = {True: "the pipeline engine (ZeRO stage 0/1 or PP > 1)", False: "the plain engine (ZeRO stage 2)"}
        raise CheckpointError(f"{tag_directory} was written by {engines[saved_by_pipeline]} but this run uses "
                              f"{engines[loading_with_pipeline]}, whose checkpoint layout differs: resume with the "
                              f"ZeRO stage the checkpoint was written with")


def _check_parallel_layout(saved: dict, config: TrainConfig, tag_directory: str) -> None:
    """TP and PP must be those of the save (``saved``: the checkpoint's ``args``): DeepSpeed would
    split or merge the weights by name and fail later, or train on a wrong slice. The data-parallel
    size may change unless ZeRO partitioned the optimizer states by it (DeepSpeed cannot repartition
    them; --no-load-optim skips them)."""
    parallel = config.parallel
    saved_layout = (saved.get("tensor_model_parallel_size"), saved.get("pipeline_model_parallel_size"))
    layout = (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size)
    if None not in saved_layout and saved_layout != layout:
        raise CheckpointError(
            f"{tag_directory} was saved with --tensor-model-parallel-size {saved_layout[0]} and "
            f"--pipeline-model-parallel-size {saved_layout[1]}; this run has {layout[0]} and {layout[1]}. Resuming "
            f"under another tensor or pipeline layout is not supported: resume with the saved sizes")
    saved_dp = saved.get("data_parallel_size")
    partitioned = glob.glob(os.path.join(tag_directory, "*zero_pp_rank_*_optim_states.pt"))
    if partitioned and saved_dp not in (None, parallel.data_parallel_size) and not config.checkpoint.no_load_optim:
        raise CheckpointError(
            f"{tag_directory} was saved with data-parallel size {saved_dp} and ZeRO-partitioned optimizer states; "
            f"this run has data-parallel size {parallel.data_parallel_size}, and DeepSpeed cannot repartition "
            f"them: resume on {saved_dp * layout[0] * layout[1]} processes, or add --no-load-optim to keep the "
            f"weights, schedule and counters and rebuild the optimizer states")


def _check_layer_files(module, tag_directory: str, tp_size: int) -> None:
    """Every layer of this pipeline stage needs one layer_XX-model_TT file per TP rank; with one
    missing, DeepSpeed fails on a bare assertion or re-splits the others."""
    for index, layer in enumerate(module.forward_funcs):
        if not hasattr(layer, "load_state_dict"):
            continue
        found = module.ckpt_layer_path_list(tag_directory, index)
        own = module.ckpt_layer_path(tag_directory, index)
        if len(found) != tp_size or own not in found:
            raise CheckpointError(f"{tag_directory} is incomplete: {os.path.basename(own)} or another TP rank's file "
                                  f"of that layer is missing ({len(found)} of {tp_size} found); "
                                  + _earlier_tag_advice(tag_directory))


READ_ERRORS = (OSError, RuntimeError, EOFError, pickle.UnpicklingError)


def _unreadable(path: str, error: Exception, tag_directory: str) -> CheckpointError:
    return CheckpointError(f"cannot read {path} ({type(error).__name__}: {error}); "
                           f"{_earlier_tag_advice(tag_directory)} or restore the file")


def _read_saved_state(tag_directory: str) -> dict:
    """The trainer state of an mp_rank_XX_model_states.pt file (the same on every rank), memory-mapped
    where the file format allows, so the weights a plain-engine file holds are not read."""
    names = sorted(glob.glob(os.path.join(tag_directory, "mp_rank_*_model_states.pt")))
    if not names:
        raise CheckpointError(f"{tag_directory} holds no mp_rank_*_model_states.pt: the checkpoint is incomplete; "
                              + _earlier_tag_advice(tag_directory))
    try:
        try:
            state = torch.load(names[0], map_location="cpu", weights_only=False, mmap=True)
        except RuntimeError:  # a file in the legacy (non-zip) format cannot be memory-mapped
            state = torch.load(names[0], map_location="cpu", weights_only=False)
    except READ_ERRORS as error:
        raise _unreadable(names[0], error, tag_directory) from error
    return state if isinstance(state, dict) else {}


@contextlib.contextmanager
def _named_read_errors(engine, tag_directory: str):
    """Every file DeepSpeed's checkpoint engine reads inside the block: a missing, truncated or
    unreadable one raises a CheckpointError that names it."""
    reader = engine.checkpoint_engine
    original_load = reader.load

    def load(path, map_location=None):
        try:
            return original_load(path, map_location=map_location)
        except READ_ERRORS as error:
            raise _unreadable(path, error, tag_directory) from error

    reader.load = load
    try:
        yield
    finally:
        reader.load = original_load


def check_before_loading(engine, config: TrainConfig) -> str | None:
    """The tag directory --load will read, after the checks above; None when there is none."""
    tag_directory = _tag_directory(config.checkpoint.load)
    if tag_directory is None:
        return None
    _check_engine_layout(engine, tag_directory)
    saved = _read_saved_state(tag_directory)
    _check_compatible(saved, config, config.checkpoint.load)
    _check_parallel_layout(saved.get("args", {}), config, tag_directory)
    if is_pipeline_engine(engine):
        _check_layer_files(engine.module, tag_directory, config.parallel.tensor_model_parallel_size)
    return tag_directory


def _restart_engine_counters(engine) -> None:
    """--finetune: DeepSpeed's step and sample counters (and so the next tag) start again from 0."""
    engine.global_steps = 0
    engine.global_samples = 0
    engine.skipped_steps = 0


def load_checkpoint(engine, config: TrainConfig) -> TrainingProgress | None:
    """Restore from --load (module docstring); None when there is nothing to load (start from scratch)."""
    settings: CheckpointConfig = config.checkpoint
    if settings.load is None:
        return None
    tag_directory = check_before_loading(engine, config)
    if tag_directory is None:
        print_rank_0(f"WARNING: no checkpoint found in --load {settings.load} (no 'latest' file): "
                     f"training starts from scratch")
        return None
    with _named_read_errors(engine, tag_directory):
        _, state = engine.load_checkpoint(settings.load, load_optimizer_states=not settings.no_load_optim,
                                          load_lr_scheduler_states=not settings.finetune)
    if settings.finetune:
        _restart_engine_counters(engine)
        progress = TrainingProgress()
    else:
        progress = TrainingProgress(**{f.name: state[f.name] for f in dataclasses.fields(TrainingProgress)})
        if not settings.no_load_rng:
            restore_rng_states(state)
    barrier()
    print_rank_0(loaded_checkpoint_line(settings.load, state["iteration"]))
    return progress
