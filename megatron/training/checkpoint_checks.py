"""What is checked before a checkpoint is read or a run may write: nothing damaged is loaded, nothing
good is overwritten.

Before any process group (``check_checkpoint_directories``, every rank, rank 0 reports):
  - --load must be a directory (a file is refused; so is a tag directory itself, with the --load
    that holds it);
  - ``latest`` in --load must name a global_stepN directory inside it: an empty, binary or overlong
    file, a path (``../run/global_step10``), or a tag that names a file, nothing, or a save that never
    finished (``saving.incomplete``) is refused with its content;
  - the manifest of the tag to resume lists every file with its size (megatron.core.checkpoint.manifest):
    a missing or truncated file is named before the model is built;
  - a --load directory that holds global_stepN directories but no ``latest`` is refused (a deleted
    ``latest`` or a wrong --load must not start from scratch);
  - a run that will start at iteration 0 (nothing to resume, or --finetune) refuses a --save that
    already holds global_stepN directories, unless --overwrite-checkpoints.
Before DeepSpeed reads anything (``check_before_loading``): the checkpoint was written by this
trainer, for the same model, engine kind, TP and PP sizes, and DP size when ZeRO partitioned the
optimizer (unless --no-load-optim); every layer file of this stage is present; a checkpoint of this
trainer without its manifest is refused unless --allow-missing-manifest (then read with a warning;
another trainer's is read with a notice: megatron.core.checkpoint.origin). While DeepSpeed reads
(``verified_reads``): each file is checked against its manifest entry (size and CRC-32) first, and
any file that cannot be read is named. Each refusal is a CheckpointError.
With --universal-checkpoint, ``latest_universal`` is read instead of ``latest``; the manifest and
the model are checked, the layout is not (a universal checkpoint fits any), and the word
embeddings it holds must fit this run's padded vocabulary (docs/checkpoint-tools.md).
"""
import glob
import os
import pickle
import re
import time
from dataclasses import dataclass

import torch

from megatron.core.checkpoint import megatron_deepspeed
from megatron.core.checkpoint.latest import LATEST as LATEST_FILENAME
from megatron.core.checkpoint.latest import UNIVERSAL_LATEST as UNIVERSAL_LATEST_FILENAME
from megatron.core.checkpoint.latest import LatestError, read_latest
from megatron.core.checkpoint.manifest import MANIFEST_NAME, SAVING_MARKER, Manifest, ManifestError, read_manifest
from megatron.core.checkpoint.names import PIPELINE_EMBEDDING_PREFIX
from megatron.core.checkpoint.origin import UnverifiedCheckpointError, unverified_reading_line
from megatron.core.checkpoint.client_state import plain_value
from megatron.core.checkpoint.sharding import saved_model_config
from megatron.training.config import CheckpointConfig, TrainConfig
from megatron.training.dist_utils import print_rank_0

UNIVERSAL_ADVICE = ("convert it with tools/convert_checkpoint/ds_to_universal.py and resume with "
                    "--universal-checkpoint")
TAG_PATTERN = re.compile(r"global_step\d+")
# Model fields whose change between save and load is an error (not a shape mismatch DeepSpeed reports).
CHECKED_MODEL_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels",
                        "padded_vocab_size", "position_embedding_type", "max_position_embeddings",
                        "glu_activation", "embed_layernorm", "apply_residual_connection_post_layernorm",
                        "num_query_groups", "normalization", "untie_embeddings_and_output_weights",
                        "add_bias_linear", "add_qkv_bias")
# The flag that sets a model field under another name.
FIELD_FLAGS = {"add_bias_linear": "--disable-bias-linear", "num_query_groups": "--num-query-groups"}
READ_ERRORS = (OSError, RuntimeError, EOFError, pickle.UnpicklingError, ManifestError)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed with this configuration; the message names the flags."""


def checkpoint_tags(directory: str) -> list[str]:
    """The global_stepN directories of ``directory`` that hold a checkpoint, by iteration: not those
    of a save that never finished (they keep the SAVING_MARKER checkpointing.py puts first)."""
    if not os.path.isdir(directory):
        return []
    tags = [name for name in os.listdir(directory)
            if TAG_PATTERN.fullmatch(name) and os.path.isdir(os.path.join(directory, name))
            and not os.path.exists(os.path.join(directory, name, SAVING_MARKER))]
    return sorted(tags, key=lambda tag: int(tag[len("global_step"):]))


def _check_load_directory(directory: str) -> None:
    """--load must be a directory, and not a checkpoint's own tag directory: DeepSpeed would find no
    ``latest`` in either and the run would start from scratch."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"--load {directory} is a file, not a checkpoint directory: give the --save directory "
                              f"of the run to resume")
    holds_files = os.path.isdir(directory) and not os.path.lexists(os.path.join(directory, LATEST_FILENAME)) and any(
        name == MANIFEST_NAME or name.startswith("mp_rank_") for name in os.listdir(directory))
    if holds_files:
        parent, tag = os.path.split(os.path.normpath(directory))
        raise CheckpointError(f"--load {directory} is a checkpoint's own directory: give the directory that holds "
                              f"it, --load {parent or '.'}, whose '{LATEST_FILENAME}' names the tag to resume ({tag})")


def _named_tag(latest: str, tag: str, directory: str, universal: bool) -> str:
    """The tag directory that ``latest``, holding ``tag``, names: a global_stepN (any directory name for
    ``latest_universal``, which ds_to_universal names after its output) inside --load ``directory``,
    complete."""
    plain = os.sep not in tag and (os.altsep is None or os.altsep not in tag) and tag not in (".", "..")
    named = os.path.join(directory, tag)
    if plain and not os.path.isdir(named):
        what = "a file" if os.path.exists(named) else "nothing"
        raise CheckpointError(f"{latest} names {named}, which is {what}: write the tag of a checkpoint "
                              f"directory there")
    if not (plain if universal else TAG_PATTERN.fullmatch(tag)):
        raise CheckpointError(f"{latest} names {tag!r}, not a {'directory' if universal else 'global_stepN directory'} "
                              f"of --load {directory}: write the tag of one of its checkpoints there; to resume "
                              f"another directory's checkpoint, give that directory as --load")
    if os.path.exists(os.path.join(named, SAVING_MARKER)):
        complete = checkpoint_tags(directory)
        known = f" (complete: {', '.join(complete[-3:])})" if complete else ""
        raise CheckpointError(f"{latest} names {named}, a save that never finished ({SAVING_MARKER} is in it): "
                              f"{earlier_tag_advice(named)}{known}")
    return named


def resume_directory(directory: str, universal: bool = False) -> str | None:
    """The directory ``latest`` (``latest_universal`` when ``universal``) names; None when there is
    nothing to resume (no ``latest``, and no global_stepN that a missing ``latest`` would leave behind)."""
    _check_load_directory(directory)
    if universal:
        latest = os.path.join(directory, UNIVERSAL_LATEST_FILENAME)
        if not os.path.lexists(latest):
            raise CheckpointError(f"--universal-checkpoint: {latest} does not exist; convert a checkpoint of "
                                  f"--load {directory} with tools/convert_checkpoint/ds_to_universal.py first")
    name = UNIVERSAL_LATEST_FILENAME if universal else LATEST_FILENAME
    latest = os.path.join(directory, name)
    try:
        tag = read_latest(directory, name)
    except LatestError as error:
        raise CheckpointError(str(error)) from None
    if tag is None:
        tags = checkpoint_tags(directory)
        if tags:
            raise CheckpointError(f"--load {directory} holds checkpoints ({', '.join(tags[-3:])}) but no 'latest' "
                                  f"file: write the tag to resume from into {latest} (e.g. {tags[-1]}), or give "
                                  f"another --load")
        return None
    return _named_tag(latest, tag, directory, universal)


def check_checkpoint_directories(settings: CheckpointConfig) -> None:
    """The filesystem checks of the module docstring that need no process group."""
    directory = None if settings.load is None else resume_directory(settings.load, settings.universal_checkpoint)
    resumes = directory is not None
    if resumes:
        _read_manifest(directory, check_present=True)
    starts_at_zero = not resumes or settings.finetune
    if settings.save is None or not starts_at_zero or settings.overwrite_checkpoints:
        return
    existing = checkpoint_tags(settings.save)
    if existing:
        why = "--finetune restarts at iteration 0" if resumes else "nothing is resumed"
        raise CheckpointError(f"--save {settings.save} already holds checkpoints ({', '.join(existing[-3:])}) and "
                              f"this run starts at iteration 0 ({why}): its saves would replace them. Resume them "
                              f"with --load {settings.save}, save elsewhere, or add --overwrite-checkpoints")


def earlier_tag_advice(tag_path: str) -> str:
    return f"point {os.path.join(os.path.dirname(tag_path), LATEST_FILENAME)} at an earlier global_stepN"


def unreadable(path: str, error: Exception, tag_path: str) -> CheckpointError:
    reason = str(error) if isinstance(error, ManifestError) else f"cannot read {path} ({type(error).__name__}: {error})"
    return CheckpointError(f"{reason}; {earlier_tag_advice(tag_path)} or restore the file")


def _check_compatible(state: dict, config: TrainConfig, directory: str, universal: bool) -> None:
    """Same model (CHECKED_MODEL_FIELDS); a universal checkpoint re-pads the vocabulary for the new TP
    size, so its padded size may differ."""
    if state.get("checkpoint_version") is None or "iteration" not in state:
        raise CheckpointError(f"{directory}: the checkpoint has no trainer state (checkpoint_version, iteration); "
                              f"it was not written by this trainer")
    arguments = state.get("args", {})
    if not isinstance(arguments, dict):  # Megatron-DeepSpeed pickles its argparse Namespace there
        raise CheckpointError(f"{directory}: the checkpoint was written by Megatron-DeepSpeed (its args entry is "
                              f"a {type(arguments).__name__}) and is read only as its own global_stepN directory: "
                              f"--load its save directory without --universal-checkpoint, or convert it with "
                              f"tools/convert_checkpoint/ds_to_universal.py")
    saved = _completed_model(arguments.get("model", {}))
    configured = plain_value(config.model)
    fields = [name for name in CHECKED_MODEL_FIELDS if not (universal and name == "padded_vocab_size")]
    differing = [f"{FIELD_FLAGS.get(name, '--' + name.replace('_', '-'))}: checkpoint {saved[name]!r}, "
                 f"configured {configured[name]!r}"
                 for name in fields if name in saved and saved[name] != configured[name]]
    if differing:
        raise CheckpointError(f"{directory}: the checkpoint's model differs from the configured one: "
                              + "; ".join(differing))


def _completed_model(saved: dict) -> dict:
    """A checkpoint's model fields with the defaults the configuration derives (g = n where the
    checkpoint stores no key/value groups, ...), so that a value left unset compares as what it meant;
    as saved where they do not make a valid configuration (the field checks then name the difference)."""
    try:
        return plain_value(saved_model_config(saved))
    except (ValueError, TypeError):
        return saved


def _check_engine_layout(engine, tag_directory: str) -> None:
    """A pipeline engine's checkpoint keeps the module in layer_XX files, the plain engine's in
    mp_rank_XX; neither engine reads the other's. Name the cause rather than fail inside DeepSpeed."""
    saved_by_pipeline = any(name.startswith("layer_") for name in os.listdir(tag_directory))
    loading_with_pipeline = engine.pipeline_layout
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
            f"--pipeline-model-parallel-size {saved_layout[1]}; this run has {layout[0]} and {layout[1]}. To resume "
            f"under another tensor or pipeline layout, {UNIVERSAL_ADVICE}; or resume with the saved sizes")
    saved_dp = saved.get("data_parallel_size")
    partitioned = glob.glob(os.path.join(tag_directory, "*zero_pp_rank_*_optim_states.pt"))
    if partitioned and saved_dp not in (None, parallel.data_parallel_size) and not config.checkpoint.no_load_optim:
        raise CheckpointError(
            f"{tag_directory} was saved with data-parallel size {saved_dp} and ZeRO-partitioned optimizer states; "
            f"this run has data-parallel size {parallel.data_parallel_size}, and DeepSpeed cannot repartition "
            f"them: resume on {saved_dp * layout[0] * layout[1]} processes, {UNIVERSAL_ADVICE}, or add "
            f"--no-load-optim to keep the weights, schedule and counters and rebuild the optimizer states")


def _check_weights_only(saved: dict, config: TrainConfig, tag_directory: str) -> None:
    """A conversion tool's output (model-only reshape, merge, transformers import) holds the weights
    and the trainer state but no optimizer and no RNG states: name the flags that load it, rather than
    fail on the first file DeepSpeed looks for."""
    settings = config.checkpoint
    weights_only = saved.get("optimizer") is None and not glob.glob(os.path.join(tag_directory, "*optim_states.pt"))
    if not weights_only:
        return
    needed = [] if settings.no_load_optim else ["--no-load-optim"]
    if not (settings.finetune or settings.no_load_rng or "random_rng_state" in saved):
        needed.append("--no-load-rng")
    if needed:
        raise CheckpointError(f"{tag_directory} holds weights only (no optimizer state: a conversion tool wrote it): "
                              f"load it with {' '.join(needed)} (or --finetune --no-load-optim to restart the schedule)")


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
                                  + earlier_tag_advice(tag_directory))


def _check_universal_vocabulary(directory: str, padded_vocab_size: int) -> None:
    """DeepSpeed pads a universal checkpoint's word embeddings with zero rows up to this run's padded
    vocabulary but cannot cut them: a smaller padded vocabulary is refused with the flag that keeps
    the saved rows (they are trained padding, seen by the softmax)."""
    path = os.path.join(directory, "zero", PIPELINE_EMBEDDING_PREFIX + "word_embeddings.weight", "fp32.pt")
    try:
        rows = torch.load(path, map_location="cpu", weights_only=False, mmap=True)["param"].shape[0]
    except READ_ERRORS + (KeyError, TypeError) as error:
        raise unreadable(path, error, directory) from error
    if rows > padded_vocab_size:
        raise CheckpointError(f"{path} holds {rows} vocabulary rows, more than this run's padded vocabulary "
                              f"({padded_vocab_size}): add --pad-vocab-size-to {rows}")


def _read_saved_state(tag_directory: str, manifest: Manifest | None) -> dict:
    """The trainer state of an mp_rank_XX_model_states.pt file (the same on every rank), verified
    against the manifest, then memory-mapped where the file format allows, so the weights a
    plain-engine file holds are not read."""
    names = sorted(glob.glob(os.path.join(tag_directory, "mp_rank_*_model_states.pt")))
    if not names:
        raise CheckpointError(f"{tag_directory} holds no mp_rank_*_model_states.pt: the checkpoint is incomplete; "
                              + earlier_tag_advice(tag_directory))
    try:
        if manifest is not None:
            manifest.verify_file(names[0], tag_directory)
        try:
            state = torch.load(names[0], map_location="cpu", weights_only=False, mmap=True)
        except RuntimeError:  # a file in the legacy (non-zip) format cannot be memory-mapped
            state = torch.load(names[0], map_location="cpu", weights_only=False)
    except READ_ERRORS as error:
        raise unreadable(names[0], error, tag_directory) from error
    return state if isinstance(state, dict) else {}


def verifying_filter(tag_directory: str, manifest: Manifest | None, verified: "VerifiedReads"):
    """A read filter (engine/interface.py): every file the engine reads is first checked against its
    manifest entry (size, CRC-32), its cost added to ``verified``; a damaged, missing, truncated or
    unreadable file raises a CheckpointError that names it."""

    def read(path: str, engine_read):
        try:
            if manifest is not None:
                started = time.perf_counter()
                manifest.verify_file(path, tag_directory)
                verified.add(os.path.getsize(path), time.perf_counter() - started)
            return engine_read()
        except READ_ERRORS as error:
            raise unreadable(path, error, tag_directory) from error

    return read


@dataclass
class VerifiedReads:
    """The files one rank checked against the manifest while loading, their bytes and the seconds it took."""

    files: int = 0
    size: int = 0
    seconds: float = 0.0

    def add(self, size: int, seconds: float) -> None:
        self.files, self.size, self.seconds = self.files + 1, self.size + size, self.seconds + seconds

    def line(self) -> str:
        return (f"  verified {self.files} files ({self.size / 1e9:.3f} GB) against the manifest in "
                f"{self.seconds:.2f} s")


def _read_manifest(tag_directory: str, check_present: bool) -> Manifest | None:
    """The tag's manifest, None without one; with ``check_present`` every listed file must be there at
    its size (a stat per file on every rank: done once, at start)."""
    try:
        manifest = read_manifest(tag_directory)
        if manifest is not None and check_present:
            manifest.check_present(tag_directory)
    except ManifestError as error:
        raise unreadable(tag_directory, error, tag_directory) from error
    return manifest


def _manifest(tag_directory: str) -> Manifest | None:
    """The manifest that verified_reads checks each read file against (their presence was checked at
    start by check_checkpoint_directories); None without one (``_without_manifest`` decides)."""
    return _read_manifest(tag_directory, check_present=False)


def _without_manifest(tag_directory: str, saved: dict, settings: CheckpointConfig) -> None:
    """A checkpoint without manifest: refused when this trainer wrote it, unless --allow-missing-manifest
    (then a warning); another trainer's gets a notice (megatron.core.checkpoint.origin)."""
    try:
        line = unverified_reading_line(tag_directory, saved, settings.allow_missing_manifest, "--allow-missing-manifest",
                                       f"restore its {MANIFEST_NAME}, or {earlier_tag_advice(tag_directory)}")
    except UnverifiedCheckpointError as error:
        raise CheckpointError(str(error)) from None
    print_rank_0(line)


def _megatron_deepspeed_state(tag_directory: str) -> dict | None:
    """The translated state of a checkpoint written by Megatron-DeepSpeed (it has no manifest), with a
    notice; None for any other (megatron.core.checkpoint.megatron_deepspeed)."""
    if _read_manifest(tag_directory, check_present=False) is not None:
        return None
    try:
        state = megatron_deepspeed.read_checkpoint_state(tag_directory)
    except megatron_deepspeed.MegatronDeepSpeedError as error:
        raise CheckpointError(f"{error}; {earlier_tag_advice(tag_directory)}") from error
    if state is not None:
        print_rank_0(f"notice: {tag_directory} was written by Megatron-DeepSpeed (no manifest): its files are loaded "
                     f"without checksum verification, its state translated (docs/compatibility.md)")
    return state


def check_before_loading(engine, config: TrainConfig) -> tuple[str, Manifest | None, dict] | None:
    """(the tag directory --load will read, its manifest, its trainer state) after the checks of the
    module docstring; None when there is nothing to resume. A universal checkpoint fits any layout and engine: only
    its manifest and model are checked."""
    universal = config.checkpoint.universal_checkpoint
    directory = resume_directory(config.checkpoint.load, universal)
    if directory is None:
        return None
    foreign = None if universal else _megatron_deepspeed_state(directory)
    manifest = None if foreign is not None else _manifest(directory)
    if not universal:
        _check_engine_layout(engine, directory)
    saved = foreign if foreign is not None else _read_saved_state(directory, manifest)
    if manifest is None and foreign is None:
        _without_manifest(directory, saved, config.checkpoint)
    _check_compatible(saved, config, config.checkpoint.load, universal)
    if universal:
        _check_universal_vocabulary(directory, config.model.padded_vocab_size)
        return directory, manifest, saved
    _check_weights_only(saved, config, directory)
    _check_parallel_layout(saved.get("args", {}), config, directory)
    if engine.pipeline_layout:
        _check_layer_files(engine.module, directory, config.parallel.tensor_model_parallel_size)
    return directory, manifest, saved
