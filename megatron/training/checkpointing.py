"""Checkpoints through the DeepSpeed engine, in Megatron-DeepSpeed's layout, plus the trainer's state.

The files, their keys and the commit protocol are described in docs/checkpoint-format.md.

``engine.save(save, "global_step{N}", client_state, ...)`` (engine/interface.py) writes the module
(one ``layer_XX-model_TT-model_states.pt`` per pipeline layer, or the whole module for the plain
engine), the optimizer partitions and ``mp_rank_MM_model_states.pt`` with the engine's own entries
(the LR schedule under ``lr_scheduler``, skipped steps, global steps and samples), to which the
client state adds the entries of megatron.core.checkpoint.client_state (the progress counters,
the model and layout, the universal-conversion patterns), at ZeRO stage 0
optimizer_parameter_names (the optimizer's parameters by name, group by group), and unless
--no-save-rng the RNG states: random_rng_state, np_rng_state, torch_rng_state, cuda_rng_state,
rng_tracker_states.

Commit: rank 0 first marks the tag directory as incomplete (``saving.incomplete``: the directory is
made under a hidden name with the marker inside, then renamed); each rank flushes
every file it writes to the disk (fsync) and records its size and CRC-32; once every rank is done,
rank 0 writes ``manifest.json`` (megatron.core.checkpoint.manifest), removes the mark, syncs the
directory, then points ``latest`` ("global_stepN") at the new tag, and then Megatron's
``latest_checkpointed_iteration.txt`` ("N"); each is replaced atomically and durably. (DeepSpeed's
own save would let rank 0 write ``latest`` as soon as its own files are done, so a job killed while
another rank is still writing would point the next run at a partial checkpoint.) Killed at any moment of a save,
or after a power loss right after it, a run resumes from a complete checkpoint. A write the
filesystem refuses (full, read-only) stops every rank with one line naming the cause, the file and
the last complete checkpoint, which ``latest`` still names (``SaveError``).

Loading (--load) takes ``latest``, after the checks of checkpoint_checks.py (nothing damaged, from
another model or layout, or incomplete is loaded). What is restored:

    default            weights, optimizer, LR schedule, counters (iteration, samples, tokens,
                       validation samples: the data position), RNG states
    --no-load-optim    no optimizer state (ZeRO rebuilds its fp32 copy from the weights); the LR
                       schedule and the counters are restored, so the run continues on schedule
    --no-load-rng      RNG states left as seeded
    --finetune         weights, and the optimizer unless --no-load-optim (as Megatron-DeepSpeed with
                       DeepSpeed); the LR schedule, counters and RNG start afresh at iteration 0
"""
import dataclasses
import os
import random
import shutil
import time
from dataclasses import dataclass

import numpy as np
import torch

from megatron.core.checkpoint import megatron_deepspeed
from megatron.core.checkpoint.client_state import (CHECKPOINT_VERSION, TrainingProgress, plain_value, saved_progress,
                                                   trainer_entries)
from megatron.core.checkpoint.latest import LATEST, LatestError, checkpoint_tag, read_latest, write_latest
from megatron.core.checkpoint.manifest import FileEntry, describe_file, fsync_path, write_manifest
from megatron.core.checkpoint.output import os_error_cause, write_pointer
from megatron.core.tensor_parallel import get_rng_tracker
from megatron.training.checkpoint_checks import (SAVING_MARKER, CheckpointError, VerifiedReads,
                                                 check_before_loading, checkpoint_tags, verifying_filter)
from megatron.training.config import CheckpointConfig, TrainConfig
from megatron.training.dist_utils import barrier, gather_objects, is_rank_0, print_rank_0, rank
from megatron.training.engine.interface import TrainingEngine
from megatron.training.engine.megatron_deepspeed_resume import own_rng_states
from megatron.training.fp8_steps import fp8_checkpoint_notice
from megatron.training.metrics import loaded_checkpoint_line, saved_checkpoint_line, saving_checkpoint_line

__all__ = ["CHECKPOINT_VERSION", "CheckpointError", "SaveError", "TrainingProgress", "load_checkpoint",
           "save_checkpoint"]


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


def client_state(progress: TrainingProgress, config: TrainConfig, pipeline: bool) -> dict:
    """What the trainer adds to DeepSpeed's mp_rank file (module docstring); ``pipeline``: saved by
    the pipeline engine."""
    state = trainer_entries(progress, config.model, config.data.orig_vocab_size, configuration_summary(config),
                            pipeline)
    if not config.checkpoint.no_save_rng:
        state.update(rng_states())
    return state


@dataclass
class WrittenFiles:
    """What one rank wrote in a save: {path relative to the tag directory: FileEntry}, and the seconds
    spent flushing and checksumming them (the manifest's cost)."""

    files: dict[str, FileEntry] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0


class SaveError(CheckpointError):
    """A save the filesystem refused (full, read-only); raised on every rank, the same line on each."""


@dataclass(frozen=True)
class WriteFailure:
    """A write of a save that the filesystem refused on one rank: the cause ("No space left on device
    (ENOSPC)") and the file, when the error names it."""

    rank: int
    cause: str
    path: str | None


def _refused(action) -> tuple[object, WriteFailure | None]:
    """(``action()``, None), or (None, the failure) when a write of it raised an OSError."""
    try:
        return action(), None
    except OSError as error:
        return None, WriteFailure(rank(), os_error_cause(error), os.fsdecode(error.filename) if error.filename else None)


def _raise_if_refused(failures: list[WriteFailure | None], directory: str, tag: str) -> None:
    """The SaveError of the first refused write of any rank (``failures``: one per rank, gathered)."""
    refused = [failure for failure in failures if failure is not None]
    if not refused:
        return
    first = refused[0]
    where = f" writing {first.path}" if first.path else ""
    ranks = f"rank {first.rank}" if len(refused) == 1 else f"ranks {', '.join(str(f.rank) for f in refused)}"
    left = (f"{tag} stays incomplete ({SAVING_MARKER}: never loaded or counted, it may be deleted)"
            if os.path.exists(os.path.join(directory, tag, SAVING_MARKER)) else f"{tag} is complete")
    raise SaveError(f"saving {tag} to --save {directory} failed: {first.cause}{where} ({ranks}); "
                    f"{_current_checkpoint(directory)}; {left}. Free space or fix the filesystem, then resume with "
                    f"--load {directory}")


def _current_checkpoint(directory: str) -> str:
    """Which checkpoint ``latest`` names after a failed save: the last complete one."""
    try:
        tag = read_latest(directory)
    except LatestError:
        tag = None
    if tag is None:
        return f"no complete checkpoint is in {directory} yet"
    return f"{os.path.join(directory, tag)} stays the last complete checkpoint ('{LATEST}' names it)"


def _start_save(tag_directory: str) -> None:
    """Rank 0: ``tag_directory`` marked incomplete. A new one is made under a hidden name with the
    marker inside, then renamed, so no kill leaves a global_stepN without it; an existing one (an
    unfinished save's, or a checkpoint --overwrite-checkpoints replaces) gets the marker in place."""
    if os.path.isdir(tag_directory):
        write_pointer(os.path.join(tag_directory, SAVING_MARKER), "")
        return
    parent, tag = os.path.split(tag_directory)
    starting = os.path.join(parent, f".{tag}.starting")
    shutil.rmtree(starting, ignore_errors=True)  # what a save killed here left
    os.makedirs(starting)
    write_pointer(os.path.join(starting, SAVING_MARKER), "")
    os.rename(starting, tag_directory)
    fsync_path(parent)


def _write_files(engine: TrainingEngine, progress: TrainingProgress, config: TrainConfig, tag_directory: str):
    """(this rank's WrittenFiles, its WriteFailure or None) of the engine's save into ``tag_directory``:
    every file flushed to the disk and described (size, CRC-32) as it is written."""
    written = WrittenFiles()

    def record(path: str) -> None:
        started = time.perf_counter()
        written.files[os.path.relpath(path, tag_directory)] = describe_file(path)
        written.seconds += time.perf_counter() - started

    state = client_state(progress, config, engine.pipeline_layout)
    _, failure = _refused(lambda: engine.save(config.checkpoint.save, os.path.basename(tag_directory), state, record))
    if failure is not None:
        # DeepSpeed's save ends in a barrier the ranks whose files are written now wait in; its other
        # collectives come before the first write.
        barrier()
    return written, failure


def _finish_save(every_rank_written: list, progress: TrainingProgress, config: TrainConfig,
                 tag_directory: str) -> list[str]:
    """Rank 0: the manifest, the marker removed, ``latest`` and the tracker, the pruning; the tags removed."""
    directory = config.checkpoint.save
    files = {name: entry for record in every_rank_written for name, entry in record.files.items()}
    write_manifest(tag_directory, progress.iteration, files)
    os.remove(os.path.join(tag_directory, SAVING_MARKER))
    fsync_path(tag_directory)
    write_latest(directory, progress.iteration)
    return prune_checkpoints(directory, config.checkpoint, os.path.basename(tag_directory))


def save_checkpoint(engine: TrainingEngine, progress: TrainingProgress, config: TrainConfig) -> None:
    """Collective: every rank writes and records its part through the engine; rank 0 then writes the
    manifest and commits (module docstring). A refused write raises SaveError on every rank, after
    the ranks have agreed on it (each phase ends in a gather of the failures)."""
    directory = config.checkpoint.save
    tag = checkpoint_tag(progress.iteration)
    tag_directory = os.path.join(directory, tag)
    started = time.perf_counter()
    print_rank_0(saving_checkpoint_line(progress.iteration, directory))
    _, failure = _refused(lambda: _start_save(tag_directory)) if is_rank_0() else (None, None)
    _raise_if_refused(gather_objects(failure), directory, tag)
    written, failure = _write_files(engine, progress, config, tag_directory)
    every_rank = gather_objects((written, failure))  # collective: every rank has finished writing
    _raise_if_refused([failure for _, failure in every_rank], directory, tag)
    every_rank_written = [written for written, _ in every_rank]
    removed, failure = _refused(lambda: _finish_save(every_rank_written, progress, config, tag_directory)) \
        if is_rank_0() else ([], None)
    _raise_if_refused(gather_objects(failure), directory, tag)
    print_rank_0(saved_checkpoint_line(progress.iteration, directory))
    files = {name: entry for record in every_rank_written for name, entry in record.files.items()}
    print_rank_0(manifest_cost_line(files, max(record.seconds for record in every_rank_written),
                                    time.perf_counter() - started))
    if removed:
        print_rank_0(f"  removed {', '.join(removed)} (--keep-last-checkpoints {config.checkpoint.keep_last_checkpoints})")


def manifest_cost_line(files: dict[str, FileEntry], seconds: float, save_seconds: float) -> str:
    gigabytes = sum(entry.size for entry in files.values()) / 1e9
    return (f"  manifest: {len(files)} files, {gigabytes:.3f} GB flushed and checksummed in {seconds:.2f} s "
            f"(slowest rank) of the save's {save_seconds:.2f} s")


def prune_checkpoints(directory: str, settings: CheckpointConfig, current_tag: str) -> list[str]:
    """--keep-last-checkpoints K: delete all complete checkpoints but the last K, never ``current_tag``
    (the one ``latest`` names) nor a --pin-checkpoints iteration; return the tags deleted. Each is
    first renamed out of the global_stepN namespace, so a deletion cut short leaves no half checkpoint
    that looks whole."""
    if not settings.keep_last_checkpoints:
        return []
    tags = checkpoint_tags(directory)
    keep = set(tags[-settings.keep_last_checkpoints:]) | {current_tag}
    keep |= {checkpoint_tag(iteration) for iteration in settings.pinned_checkpoints}
    removed = [tag for tag in tags if tag not in keep]
    for tag in removed:
        doomed = os.path.join(directory, f".deleting-{tag}")
        os.replace(os.path.join(directory, tag), doomed)
        shutil.rmtree(doomed)
    return removed


def load_checkpoint(engine: TrainingEngine, config: TrainConfig) -> TrainingProgress | None:
    """Restore from --load (module docstring); None when there is nothing to load (start from scratch)."""
    settings: CheckpointConfig = config.checkpoint
    if settings.load is None:
        return None
    checked = check_before_loading(engine, config)
    if checked is None:
        print_rank_0(f"WARNING: no checkpoint found in --load {settings.load} (no 'latest' file): "
                     f"training starts from scratch")
        return None
    tag_directory, manifest, saved = checked
    fp8_notice = fp8_checkpoint_notice(saved.get("args"), config.model, settings.universal_checkpoint)
    if fp8_notice:
        print_rank_0(fp8_notice)
    universal = settings.universal_checkpoint
    foreign = not universal and megatron_deepspeed.is_translated(saved)
    verified = VerifiedReads()
    # An imported model has no schedule to restore: the configured one starts.
    state = engine.load(settings.load, tag_directory, load_optimizer=not settings.no_load_optim,
                        load_lr_scheduler=not settings.finetune and saved.get("lr_scheduler") is not None,
                        read_filters=[verifying_filter(tag_directory, manifest, verified)], universal=universal,
                        megatron_deepspeed=foreign)
    if settings.finetune:
        engine.restart_counters()
        progress = TrainingProgress()
    else:
        progress = saved_progress(state)
        if universal:
            print_rank_0("  RNG states not restored from the universal checkpoint (they belong to the saved layout's "
                         "ranks): each rank starts from its seeded state")
        elif not settings.no_load_rng:
            restore_rng_states(own_rng_states(state) if foreign else state)
    barrier()
    print_rank_0(loaded_checkpoint_line(settings.load, state["iteration"]))
    if manifest is not None:
        print_rank_0(verified.line())
    return progress
