"""Which DeepSpeed this engine runs on, and every method or attribute of DeepSpeed's that it replaces.

The trainer changes DeepSpeed's behaviour for speed or correctness only here, each change declared in
``REPLACEMENTS`` with the DeepSpeed versions it was written for. ``check_deepspeed`` runs right after
the flags are parsed, before any process group:

    installed version in SUPPORTED         every replacement on
    outside, --allow-untested-deepspeed    a warning naming the replacements left off; DeepSpeed's
                                           own code runs there
    outside, no flag                       UnsupportedDeepSpeedError: one line, exit 2

A replacement is applied only through ``replace`` (or ``replaced_for_block``), which does nothing when
its entry is off, so an untested DeepSpeed never sees a change that was not written for it.
"""
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import pathlib
import re

import deepspeed

from megatron.training.argument_types import ArgumentError

SUPPORTED = ((0, 19), (0, 20))  # [first, end): DeepSpeed 0.19.x, what the suite and the GPU benchmarks run
ALLOW_FLAG = "--allow-untested-deepspeed"


class UnsupportedDeepSpeedError(ArgumentError):
    """The installed DeepSpeed is outside SUPPORTED (or lacks what a replacement needs)."""


@dataclasses.dataclass(frozen=True)
class Replacement:
    """``target`` (a DeepSpeed class or module attribute, dotted from ``deepspeed.``) replaced by the
    engine function ``by`` for ``purpose``; written for DeepSpeed versions [first, end)."""

    target: str
    by: str
    purpose: str
    versions: tuple[tuple[int, int], tuple[int, int]] = SUPPORTED

    @property
    def owner_and_attribute(self) -> tuple[str, str]:
        owner, _, attribute = self.target.rpartition(".")
        return owner, attribute


BF16 = "runtime.bf16_optimizer.BF16_Optimizer"
ENGINE = "runtime.engine.DeepSpeedEngine"
PIPE_ENGINE = "runtime.pipe.engine.PipelineEngine"
PIPE_MODULE = "runtime.pipe.module.PipelineModule"
CHECKPOINT_ENGINE = "runtime.checkpoint_engine.torch_checkpoint_engine.TorchCheckpointEngine"

REPLACEMENTS = {replacement.by: replacement for replacement in (
    Replacement(f"{BF16}._update_hp_grad", "bf16_steps.accumulate_in_one_kernel",
                "hp += lp in one kernel, without an fp32 copy of each bf16 gradient"),
    Replacement(f"{BF16}.clear_hp_grads", "bf16_steps.fuse_weight_gradient_accumulation",
                "dW added into the fp32 accumulator by its GEMM (--gradient-accumulation-fusion)"),
    Replacement(f"{BF16}.get_grads_for_norm", "bf16_steps.norm_in_few_kernels",
                "the gradient norm in one kernel per group"),
    Replacement(f"{BF16}.update_lp_params", "bf16_steps.adamw_writes_bf16_weights",
                "AdamW and the bf16 copy of the weights in one pass"),
    Replacement(f"{BF16}.step", "bf16_steps.clip_in_adamw",
                "the clip as the fused AdamW's grad_scale"),
    Replacement(f"{PIPE_ENGINE}._bf16_reduce_grads", "bf16_steps.skip_single_rank_reduction",
                "no bf16 round trip of the accumulators at DP = 1"),
    Replacement(f"{ENGINE}.clip_fp32_gradients", "fp32_steps.guard_fp32_steps",
                "the fp32 step without ZeRO: exact global-norm clip, no update on a NaN gradient"),
    Replacement(f"{ENGINE}._take_model_step", "fp32_steps.count_zeros_before_each_step",
                "--log-num-zeros-in-grad"),
    Replacement(f"{ENGINE}._take_model_step", "fp32_steps.synchronize_after_each_step",
                "--sync-tp-duplicated-parameters"),
    Replacement(f"{PIPE_MODULE}._partition_layers", "pipeline_module.GPTModelPipe._partition_layers",
                "the 'flops' partition method"),
    Replacement(f"{PIPE_MODULE}._synchronize_tied_weights", "pipeline_module.GPTModelPipe._synchronize_tied_weights",
                "the tied-weight broadcast without autograd recording it"),
    Replacement(f"{PIPE_MODULE}.get_tied_weights_and_groups",
                "pipeline_module.GPTModelPipe.get_tied_weights_and_groups",
                "sequence-parallel gradients summed once per step with the tied ones"),
    Replacement(f"{CHECKPOINT_ENGINE}.save", "checkpoint_io.recorded_writes",
                "every checkpoint file flushed and described for the manifest"),
    Replacement(f"{CHECKPOINT_ENGINE}.load", "checkpoint_io.filtered_reads",
                "every checkpoint file checked against the manifest, Megatron-DeepSpeed's translated"),
    Replacement(f"{ENGINE}._get_ckpt_name", "checkpoint_io.zero3_model_states",
                "ZeRO-3's module saved and read as mp_rank_MM_model_states.pt, the plain engine's layout"),
    Replacement(f"{ENGINE}.module_state_dict", "checkpoint_io.zero3_gathered_module",
                "ZeRO-3's module saved whole (gathered module by module), not as empty placeholders"),
    Replacement(f"{ENGINE}.save_non_zero_checkpoint", "checkpoint_io.zero3_one_writer",
                "one ZeRO-3 module file per model-parallel rank, written by its DP rank 0"),
    Replacement(f"{ENGINE}.zero_optimization_partition_weights", "checkpoint_io.zero3_module_reads",
                "a ZeRO-3 load without the optimizer reads the module file, not zero_to_fp32's rebuild"),
    Replacement("runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state",
                "checkpoint_io.zero3_universal_reads",
                "a universal checkpoint loads at ZeRO-3 cut by TP, then by DP, each group keeping its settings"),
    Replacement("runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3.grad_partitions_flat_buffer",
                "zero3.share_offloaded_gradient_partitions",
                "under optimizer offload (unpinned), the fp32 gradients are views of the accumulation buffer: 4 "
                "bytes per parameter less host memory"),
    Replacement("runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.param_names", "checkpoint_io.universal_parameter_names",
                "the plain engine's optimizer names its parameters as a universal checkpoint does"),
    Replacement("comm.torch.TorchBackend.all_gather_function", "distributed.use_current_collective_names",
                "torch's current name of all_gather_into_tensor (no FutureWarning per call)"),
    Replacement("runtime.zero.muon.muon_optimizer", "deepspeed_engine.without_muon",
                "DeepSpeed's type checks against Muon without importing it (and torch's inductor) at every start"),
    Replacement("runtime.activation_checkpointing.checkpointing._CUDA_RNG_STATE_TRACKER",
                "activation_checkpointing.share_rng_tracker",
                "DeepSpeed's recomputation replays the model-parallel dropout masks"),
)}

_disabled: set[str] = set()


def version_tuple(version: str) -> tuple[int, int]:
    """"0.19.8+abc" -> (0, 19)."""
    major, minor = (version.split("+")[0].split(".") + ["0"])[:2]
    return int(major), int(re.match(r"\d*", minor).group() or 0)


def _in_range(version: tuple[int, int], versions) -> bool:
    first, end = versions
    return first <= version < end


def _range_text(versions) -> str:
    (first_major, first_minor), (end_major, end_minor) = versions
    return f">={first_major}.{first_minor},<{end_major}.{end_minor}"


def _resolve(dotted: str):
    """The DeepSpeed module or class at ``deepspeed.<dotted>``, or None."""
    parts = f"deepspeed.{dotted}".split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            found = getattr(found, name, None)
        return found
    return None


@functools.cache
def _class_text(owner: type) -> str:
    """The lines of top-level class ``owner`` in its file: from ``class <name>`` to the next line at
    column 0. Text, not ``inspect.getsource``, which tokenizes in Python (~0.4 s for DeepSpeed's
    engine, at every process start)."""
    lines = pathlib.Path(inspect.getsourcefile(owner)).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"class {owner.__name__}\b", line))
    end = next((i for i in range(start + 1, len(lines)) if lines[i][:1] not in ("", " ", "\t", "#", ")")), len(lines))
    return "\n".join(lines[start:end])


def _assigns(owner: type, attribute: str) -> bool:
    """Whether class ``owner`` assigns ``self.<attribute>`` (plain or annotated assignment)."""
    return re.search(rf"self\.{attribute}\s*(:[^=\n]*)?=(?!=)", _class_text(owner)) is not None


def missing_targets() -> list[str]:
    """The targets of REPLACEMENTS the installed DeepSpeed lacks: a class or module attribute, an
    instance attribute its class assigns (``self.<name> =``), or a submodule (found, not imported)."""
    missing = []
    for replacement in REPLACEMENTS.values():
        owner_path, attribute = replacement.owner_and_attribute
        owner = _resolve(owner_path)
        present = owner is not None and (hasattr(owner, attribute) or (
            inspect.isclass(owner) and _assigns(owner, attribute)) or (
            inspect.ismodule(owner) and importlib.util.find_spec(f"{owner.__name__}.{attribute}") is not None))
        if not present:
            missing.append(replacement.target)
    return sorted(set(missing))


def check_deepspeed(allow_untested: bool, version: str | None = None) -> list[str]:
    """Check the installed DeepSpeed before any process group; returns the warning lines to print.

    Raises UnsupportedDeepSpeedError (one line) when the version is outside SUPPORTED, naming the
    installed and supported versions, or when a replacement's target is missing; with
    ``allow_untested`` those replacements are switched off instead and named in the warning."""
    version = version or deepspeed.__version__
    installed = version_tuple(version)
    _disabled.clear()
    if _in_range(installed, SUPPORTED):
        missing = set(missing_targets())
        off = sorted(name for name, replacement in REPLACEMENTS.items() if replacement.target in missing)
        problem = f"DeepSpeed {version} lacks what the engine replaces ({', '.join(sorted(missing))})"
    else:
        off = sorted(name for name, replacement in REPLACEMENTS.items()
                     if not _in_range(installed, replacement.versions))
        problem = (f"DeepSpeed {version} is installed; this trainer supports deepspeed{_range_text(SUPPORTED)} "
                   f"(pip install 'deepspeed{_range_text(SUPPORTED)}')")
    if not off:
        return []
    if not allow_untested:
        raise UnsupportedDeepSpeedError(f"{problem}, or pass {ALLOW_FLAG} to run with its replacements of "
                                        f"DeepSpeed's methods off")
    _disabled.update(off)
    return [f"WARNING: {problem} ({ALLOW_FLAG}); DeepSpeed's own code runs instead of these replacements: "
            f"{', '.join(off)}"]


def is_enabled(name: str) -> bool:
    """Whether the replacement ``name`` (a key of REPLACEMENTS) applies to this DeepSpeed."""
    if name not in REPLACEMENTS:
        raise KeyError(f"{name} is not declared in megatron.training.engine.replacements.REPLACEMENTS")
    return name not in _disabled


def replace(name: str, owner, attribute: str, value) -> bool:
    """``owner.attribute = value`` under the declared replacement ``name``; False (nothing changed)
    when it is off or ``owner`` has no such attribute."""
    if not is_enabled(name) or not hasattr(owner, attribute):
        return False
    setattr(owner, attribute, value)
    return True


@contextlib.contextmanager
def replaced_for_block(name: str, owner, attribute: str, value):
    """``replace`` inside the block only; the original is put back after it."""
    original = getattr(owner, attribute)
    changed = replace(name, owner, attribute, value)
    try:
        yield changed
    finally:
        if changed:
            setattr(owner, attribute, original)
