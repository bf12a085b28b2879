"""The trainer's side of FP8: each step's end (``end_fp8_step``) and what the log line reports of it.

After every optimizer step (an fp16-skipped one too: the step's amaxes were recorded all the same)
``Fp8Steps.end_step`` ends the FP8 step of the model's layers: the weights' FP8 copies are forgotten
and delayed scaling's amaxes are max-reduced over the tensor-parallel, then the data-parallel group
(the ranks holding the same layers) before the new scales. It returns that step's counts of amaxes
that overflowed (saturated) or underflowed their scales, summed over layers and roles; the log line
reports their sum over the interval with the format and recipe:

    ... | quantization: FP8 hybrid delayed | amax overflows: 0 | amax underflows: 2 |

(the counts only under delayed scaling, whose scales come from earlier steps; current scaling
cannot overflow). Evaluation runs inside ``keep_delayed_amaxes``, so its forwards leave the training
step's recorded amaxes as they were. ``fp8_checkpoint_notice`` says when a loaded checkpoint's FP8 state does not
carry over (a run with or without FP8, another recipe or history length).
"""
import contextlib
from dataclasses import dataclass

import torch

from megatron.core.models.gpt.config import GPTModelConfig
from megatron.core.tensor_parallel.fp8 import DelayedScaling, Fp8Config
from megatron.core.tensor_parallel.fp8_linear import Fp8Gemms, end_fp8_step


@dataclass(frozen=True)
class Fp8Counts:
    """Delayed-scaling amaxes that overflowed / underflowed their scales (over layers and roles)."""

    overflows: int
    underflows: int


class Fp8Steps:
    """The FP8 step ends of one run and the counts of the current log interval (module docstring)."""

    def __init__(self, fp8: Fp8Config, groups: list):
        self.fp8, self.groups = fp8, groups
        self.overflows = self.underflows = 0

    def end_step(self, module: torch.nn.Module) -> Fp8Counts | None:
        """Collective over ``groups``. The step's counts (None without delayed scaling), added to the interval's."""
        counts = end_fp8_step(module, self.groups)
        if counts is None:
            return None
        step = Fp8Counts(int(counts.overflows), int(counts.underflows))
        self.overflows += step.overflows
        self.underflows += step.underflows
        return step

    def interval_fields(self) -> tuple[str, Fp8Counts | None]:
        """(the quantization's description, the interval's counts or None); the counts restart."""
        counts = Fp8Counts(self.overflows, self.underflows) if self.fp8.recipe == "delayed" else None
        self.overflows = self.underflows = 0
        return f"FP8 {self.fp8.format} {self.fp8.recipe}", counts


@contextlib.contextmanager
def keep_delayed_amaxes(module: torch.nn.Module):
    """The amaxes delayed scaling records in the block (evaluation forwards) are forgotten at its end:
    the next training step's scales depend on training alone. The weights' FP8 copies made in the
    block are forgotten too, so that the training step quantizes them again and records their amaxes."""
    states = [child for child in module.modules() if isinstance(child, DelayedScaling)]
    recorded = [state.amax_history[0].clone() for state in states]
    try:
        yield
    finally:
        for state, amaxes in zip(states, recorded):
            state.amax_history[0].copy_(amaxes)
        for gemms in (child for child in module.modules() if isinstance(child, Fp8Gemms)):
            gemms.forget_weight()


_STARTS_FRESH = "the amax histories and scales start fresh (the first step quantizes with current amaxes)"


def _delayed(fp8: Fp8Config | None) -> Fp8Config | None:
    return fp8 if fp8 is not None and fp8.recipe == "delayed" else None


def fp8_checkpoint_notice(saved_args, configured: GPTModelConfig, universal: bool = False) -> str | None:
    """The line to print when a checkpoint's FP8 state (delayed scaling's amax histories and scales,
    ``saved_args``: its ``args`` entry) does not carry over to this run's, None when it does or
    neither has one. A universal checkpoint (``universal``) holds weights and optimizer states only.
    The layers themselves drop what they cannot take and keep their fresh state (``tensor_parallel.layers``)."""
    saved_model = saved_args.get("model") if isinstance(saved_args, dict) else None
    saved_fp8 = saved_model.get("fp8") if isinstance(saved_model, dict) else None
    saved = _delayed(Fp8Config(**saved_fp8) if isinstance(saved_fp8, dict) else None)
    ours = _delayed(configured.fp8)
    if saved is None and ours is None:
        return None
    if ours is None:
        run = "has no FP8" if configured.fp8 is None else f"uses the {configured.fp8.recipe} recipe"
        return f"notice: the checkpoint's FP8 delayed-scaling state (amax histories, scales) is dropped: this run {run}"
    if universal:
        return f"notice: a universal checkpoint holds no FP8 delayed-scaling state: {_STARTS_FRESH}"
    if saved is None:
        return f"notice: the checkpoint has no FP8 delayed-scaling state: {_STARTS_FRESH}"
    if saved.amax_history_len != ours.amax_history_len:
        return (f"notice: the checkpoint's FP8 amax history holds {saved.amax_history_len} steps, this run's "
                f"{ours.amax_history_len} (--fp8-amax-history-len): the histories and scales start fresh")
    return None
