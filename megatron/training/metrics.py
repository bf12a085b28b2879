"""What the training loop reports: Megatron-DeepSpeed's log line, validation and memory lines, milestone
lines and the final summary, with the loss accumulator behind them.

Formats follow Megatron-DeepSpeed's character for character (docs/logging.md lists them); the
functions return strings and the trainer prints them on the rank Megatron-DeepSpeed uses (the log
line on the last rank, milestones on rank 0).

Throughput and FLOPs are counted in throughput.py, the matmul peak measured in matmul_peak.py.
"""
import math
import resource
from dataclasses import dataclass, field
from datetime import datetime
from typing import Mapping

import torch

from megatron.training.throughput import model_tflops_and_mfu

VALIDATION_END_PREFIX = "the end of training for val data"
TEST_END_PREFIX = "the end of training for test data"
BUILDING_DATASETS_LINE = "> building train, validation, and test datasets ..."
PARAMETERS_HEADER_LINE = "Number of parameters: [tensor rank - pipeline rank] w/ and w/o embeddings:"
MEGABYTE = 1024.0 * 1024.0


# ---------------------------------------------------------------------------------------- the log line


class LossAccumulator:
    """The losses and iteration counts between two log lines (Megatron-DeepSpeed's ``total_loss_dict``).

    An applied ("advanced") iteration adds its losses to the sums; a skipped one (an fp16 overflow,
    a NaN/Inf loss or gradient, or --skip-train-iteration-range) adds nothing, and counts as a nan
    iteration when the trainer says so (``nan``: a NaN or Inf loss or gradient norm that is not an
    fp16 overflow).
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.loss_sums: dict[str, float] = {}
        self.advanced_iterations = 0
        self.skipped_iterations = 0
        self.nan_iterations = 0

    def add(self, losses: Mapping[str, float], skipped: bool, nan: bool = False):
        if not skipped:
            self.advanced_iterations += 1
            for key, value in losses.items():
                self.loss_sums[key] = self.loss_sums.get(key, 0.0) + float(value)
            return
        self.skipped_iterations += 1
        if nan:
            self.nan_iterations += 1

    @property
    def total_iterations(self) -> int:
        return self.advanced_iterations + self.skipped_iterations

    def averages(self) -> dict[str, float]:
        """Loss sums divided by max(1, advanced iterations)."""
        return {key: total / max(1, self.advanced_iterations) for key, total in self.loss_sums.items()}


@dataclass(frozen=True)
class TrainingLogFields:
    """The values of one log line. Optional fields are printed only when not None.

    ``losses``: interval averages (a loss is printed only when > 0, as in Megatron-DeepSpeed). ``loss_scale``:
    pass it only with --fp16. ``params_norm``: only with --log-params-norm. ``curriculum_seqlen``:
    only with curriculum learning. ``mfu``: only when a matmul peak was measured. ``quantization``: only
    with FP8 ("FP8 hybrid delayed"), ``amax_overflows`` / ``amax_underflows`` only with delayed scaling.
    """

    iteration: int
    train_iters: int
    consumed_samples: int
    consumed_tokens: int
    elapsed_time_per_iteration: float
    learning_rate: float
    global_batch_size: int
    skipped_iterations: int
    nan_iterations: int
    samples_per_second: float
    tflops: float
    losses: Mapping[str, float] = field(default_factory=dict)
    loss_scale: float | None = None
    grad_norm: float | None = None
    num_zeros: float | None = None
    params_norm: float | None = None
    curriculum_seqlen: int | None = None
    model_tflops: float | None = None
    mfu: float | None = None
    eta_seconds: float | None = None
    quantization: str | None = None
    amax_overflows: int | None = None
    amax_underflows: int | None = None


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (hours unbounded), rounded to the second: 3725.4 -> "1:02:05"."""
    total = max(0, int(round(seconds)))
    return f"{total // 3600}:{total % 3600 // 60:02d}:{total % 60:02d}"


def remaining_seconds(iteration: int, train_iters: int, consumed_tokens: int, train_tokens: int | None,
                      tokens_per_iteration: int, seconds_per_iteration: float) -> float:
    """Time left at ``seconds_per_iteration``: until --train-iters, or the --train-tokens stop if sooner."""
    iterations_left = max(0, train_iters - iteration)
    if train_tokens is not None and tokens_per_iteration > 0:
        iterations_left = min(iterations_left, max(0, -(-(train_tokens - consumed_tokens) // tokens_per_iteration)))
    return iterations_left * seconds_per_iteration


def training_log_line(fields: TrainingLogFields) -> str:
    """Megatron-DeepSpeed's per-iteration line (docs/logging.md), then our three fields.

    After `` TFLOPs: x.xx |`` come `` model TFLOP/s: x.xx |`` (per GPU, the model FLOPs of the module
    docstring), `` MFU: xx.xx% |`` (model TFLOP/s over the measured matmul peak, as a percentage with
    two decimals) and `` ETA: H:MM:SS |`` (the time left at this interval's speed), each when given;
    with FP8, `` quantization: FP8 {format} {recipe} |`` and, under delayed scaling, `` amax overflows: n |
    amax underflows: m |`` (the interval's delayed-scaling amaxes that saturated / underflowed their scales).
    """
    f = fields
    line = f" iteration {f.iteration:8d}/{f.train_iters:8d} |"
    line += f" consumed samples: {f.consumed_samples:12d} |"
    line += f" consumed tokens: {f.consumed_tokens:12d} |"
    line += f" elapsed time per iteration (s): {f.elapsed_time_per_iteration:.2f} |"
    line += f" learning rate: {f.learning_rate:.3E} |"
    line += f" global batch size: {f.global_batch_size:5d} |"
    for key, average in f.losses.items():
        if average > 0.0:
            line += f" {key}: {average:.6E} |"
    if f.loss_scale is not None:
        line += f" loss scale: {f.loss_scale:.1f} |"
    if f.grad_norm is not None:
        line += f" grad norm: {f.grad_norm:.3f} |"
    if f.num_zeros is not None:
        line += f" num zeros: {f.num_zeros:.1f} |"
    if f.params_norm is not None:
        line += f" params norm: {f.params_norm:.3f} |"
    if f.curriculum_seqlen is not None:
        line += f" curriculum seqlen: {f.curriculum_seqlen:5d} |"
    line += f" number of skipped iterations: {f.skipped_iterations:3d} |"
    line += f" number of nan iterations: {f.nan_iterations:3d} |"
    line += f" samples per second: {f.samples_per_second:.3f} |"
    line += f" TFLOPs: {f.tflops:.2f} |"
    if f.model_tflops is not None:
        line += f" model TFLOP/s: {f.model_tflops:.2f} |"
    if f.mfu is not None:
        line += f" MFU: {f.mfu:.2%} |"
    if f.eta_seconds is not None:
        line += f" ETA: {format_duration(f.eta_seconds)} |"
    if f.quantization is not None:
        line += f" quantization: {f.quantization} |"
    if f.amax_overflows is not None:
        line += f" amax overflows: {f.amax_overflows:d} | amax underflows: {f.amax_underflows:d} |"
    return line


# ---------------------------------------------------------------------------------------- validation


def perplexity(loss: float) -> float:
    """exp(min(20, loss)), as Megatron-DeepSpeed reports it."""
    return math.exp(min(20.0, loss))


def validation_prefix(iteration: int) -> str:
    """The ``prefix`` of an evaluation during training; the end of training uses the *_END_PREFIX strings."""
    return f"iteration {iteration}"


def validation_log_lines(prefix: str, losses: Mapping[str, float], group_name: str | None = None) -> list[str]:
    """The three lines of an evaluation: dashes, ``validation loss at {prefix} | {key} value: ... |``, dashes.

    With a named validation group the line starts with ``{group_name} loss at``. The dash lines are
    one character longer than the middle line, which ends with ``| `` (no leading space).
    """
    line = f"{group_name} loss at {prefix} | " if group_name is not None else f"validation loss at {prefix} | "
    for key, value in losses.items():
        line += f"{key} value: {value:.6E} | "
        line += f"{key} PPL: {perplexity(value):.6E} | "
    dashes = "-" * (len(line) + 1)
    return [dashes, line, dashes]


# ---------------------------------------------------------------------------------------- summary


@dataclass
class RunTotals:
    """What this process trained since it started (or resumed): the final summary's throughput.

    ``seconds`` counts iteration time only (evaluation and checkpoints excluded), as the log line does.
    """

    iterations: int = 0
    samples: int = 0
    tokens: int = 0
    model_flops: float = 0.0
    seconds: float = 0.0

    def add_iteration(self, samples: int, tokens: int, model_flops: float) -> None:
        self.iterations += 1
        self.samples += samples
        self.tokens += tokens
        self.model_flops += model_flops


SUMMARY_PREFIX = " training summary |"


def run_summary_lines(totals: RunTotals, iteration: int, consumed_samples: int, consumed_tokens: int,
                      losses: Mapping[str, float], world_size: int, peak_tflops: float | None) -> list[str]:
    """The end-of-run summary: where training stands, the last losses, and this run's throughput.

    ``losses``: label -> loss, e.g. {"train lm loss": ..., "validation lm loss": ..., "test lm loss": ...};
    validation and test losses also get their perplexity. Throughput is this run's totals over its
    iteration time: samples and tokens per second, model TFLOP/s per GPU and MFU.
    """
    where = (f"{SUMMARY_PREFIX} iterations: {iteration} ({totals.iterations} in this run) |"
             f" consumed samples: {consumed_samples} | consumed tokens: {consumed_tokens} |")
    loss_line = SUMMARY_PREFIX
    for label, value in losses.items():
        loss_line += f" {label}: {value:.6E} |"
        if not label.startswith("train"):
            loss_line += f" {label} PPL: {perplexity(value):.6E} |"
    speed = f"{SUMMARY_PREFIX} iteration time in this run: {format_duration(totals.seconds)} |"
    if totals.seconds > 0 and totals.iterations:
        tflops, mfu = model_tflops_and_mfu(totals.model_flops, totals.seconds, world_size, peak_tflops)
        speed += (f" samples per second: {totals.samples / totals.seconds:.3f} |"
                  f" tokens per second: {totals.tokens / totals.seconds:.1f} | model TFLOP/s per GPU: {tflops:.4g} |")
        if mfu is not None:
            speed += f" MFU: {mfu:.2%} |"
    return [where] + ([loss_line] if losses else []) + [speed]


# ---------------------------------------------------------------------------------------- memory


def memory_report_line(rank: int, iteration: int, device=None, moment: str | None = None) -> str:
    """``[Rank r] (after N iterations) memory (MB) | allocated: ... | max allocated: ... | reserved: ... |
    max reserved: ...`` from the CUDA allocator of ``device``; ``moment`` replaces "after N iterations"
    (the line after set-up: what the model, optimizer and engine hold before the first step, and the
    peak of building them).

    On CPU (``device`` None or a CPU device) the process's peak resident set size is reported
    instead: ``[Rank r] (after N iterations) memory (MB) | max resident: ...``.
    """
    label = f"[Rank {rank}] ({moment or f'after {iteration} iterations'}) memory (MB)"
    if device is None or torch.device(device).type != "cuda":
        # ru_maxrss is in kilobytes on Linux.
        max_resident = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        return f"{label} | max resident: {max_resident}"
    return (f"{label} | allocated: {torch.cuda.memory_allocated(device) / MEGABYTE}"
            f" | max allocated: {torch.cuda.max_memory_allocated(device) / MEGABYTE}"
            f" | reserved: {torch.cuda.memory_reserved(device) / MEGABYTE}"
            f" | max reserved: {torch.cuda.max_memory_reserved(device) / MEGABYTE}")


# ---------------------------------------------------------------------------------------- milestones


def parameter_count_lines(parameters_billions: float, parameters_without_embeddings_billions: float) -> list[str]:
    """``estimated model parameters: X`` and ``... without embeddings: Y`` (billions, whole model)."""
    return [f"estimated model parameters: {parameters_billions}",
            f"estimated model parameters without embeddings: {parameters_without_embeddings_billions}"]


def rank_parameter_line(tp_rank: int, pp_rank: int, parameters_billions: float,
                        parameters_without_embeddings_billions: float) -> str:
    """``[TTT-PPP] X.XXXXB / Y.YYYYB``: one (tensor, pipeline) rank's parameters with and without embeddings."""
    return (f"[{tp_rank:0>3d}-{pp_rank:0>3d}] {parameters_billions:.4f}B / "
            f"{parameters_without_embeddings_billions:.4f}B")


def initialization_time_line(seconds: float) -> str:
    return f"time to initialize megatron (seconds): {seconds:.3f}"


def datetime_line(label: str, now: datetime | None = None) -> str:
    """``[label] datetime: YYYY-MM-DD HH:MM:SS `` (with Megatron-DeepSpeed's trailing space)."""
    now = datetime.now() if now is None else now
    return f"[{label}] datetime: {now.strftime('%Y-%m-%d %H:%M:%S')} "


def train_iterations_line(train_iters: int) -> str:
    return f"setting training iterations to {train_iters}"


def saving_checkpoint_line(iteration: int, directory: str) -> str:
    return f"saving checkpoint at iteration {iteration:7d} to {directory}"


def saved_checkpoint_line(iteration: int, directory: str) -> str:
    return f"  successfully saved checkpoint at iteration {iteration:7d} to {directory}"


def loaded_checkpoint_line(directory: str, iteration: int) -> str:
    return f"  successfully loaded checkpoint from {directory} at iteration {iteration}"


def kill_switch_line(path: str) -> str:
    return f"Detected kill switch at {path}. Exiting"


def skipped_iterations_line(start: int, end: int) -> str:
    return f"Skipped iterations {start} to {end} due to --skip-train-iteration-range flag."


def stop_line(reason: str, iteration: int, save_directory: str | None) -> str:
    """Where a run stopped for ``reason`` ("received SIGTERM", "the deepspeed launcher (pid 7) has
    ended") stands and how to resume it."""
    if save_directory is None:
        return f"{reason}: exiting after iteration {iteration} without a checkpoint (no --save)"
    return (f"{reason}: saved a checkpoint at iteration {iteration} in {save_directory}; "
            f"resume with the same command and --load {save_directory}")


def exit_after_minutes_label(minutes: float) -> str:
    """Label for ``datetime_line`` when --exit-duration-in-mins stops the run."""
    return f"exiting program after {minutes} minutes"


def exit_at_iteration_label(iteration: int) -> str:
    """Label for ``datetime_line`` when --exit-interval stops the run."""
    return f"exiting program at iteration {iteration}"
