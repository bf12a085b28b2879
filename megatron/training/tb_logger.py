"""TensorBoard scalars with Megatron-DeepSpeed's tag names and x-axes, so existing dashboards keep
working (docs/logging.md lists every tag); with --wandb-project the same scalars also go to a
Weights & Biases run (wandb_logger.py).

x-axes: "vs samples" tags use the consumed training samples as the step, "vs tokens" the consumed
tokens, "vs gigaflos (without embeddings)" Megatron-DeepSpeed's accumulated 6·samples·s·params(B);
every other tag uses the iteration. Only the rank the trainer enables (the last rank, as in
Megatron-DeepSpeed, and Megatron-LM's W&B writer) creates a writer; elsewhere every method returns at
once. Each (re)start opens a new events file and a new W&B run.

Ours, beside Megatron-DeepSpeed's tags: ``iteration-time/model TFLOP/s per gpu`` and, when a matmul
peak was measured, ``iteration-time/MFU``; the test set's loss under ``lm-loss-test/`` (Megatron-
DeepSpeed wrote it into the validation tags at the last step); ``iteration-time/world_size`` holds
one value per start (Megatron-DeepSpeed wrote the size and then a 0 one step later).
"""
from dataclasses import dataclass
from collections.abc import Mapping

from megatron.training.metrics import perplexity
from megatron.training.throughput import Throughput
from megatron.training.wandb_logger import WandbRun, WandbSettings


@dataclass(frozen=True)
class TensorBoardSettings:
    """The TensorBoard flags (they also choose the scalars W&B gets).

    log_dir: --tensorboard-dir, or None to write only to W&B; queue_size: --tensorboard-queue-size
    (SummaryWriter max_queue); log_interval: --tensorboard-log-interval; log_timers: --log-timers-to-tensorboard;
    log_batch_size: --log-batch-size-to-tensorboard; log_learning_rate: not
    --no-log-learnig-rate-to-tensorboard (sic); log_loss_scale: not --no-log-loss-scale-to-tensorboard;
    log_validation_ppl: --log-validation-ppl-to-tensorboard.
    """

    log_dir: str | None
    queue_size: int = 1000
    log_interval: int = 1
    log_timers: bool = False
    log_batch_size: bool = False
    log_learning_rate: bool = True
    log_loss_scale: bool = True
    log_validation_ppl: bool = False

    def __post_init__(self):
        if self.queue_size < 1:
            raise ValueError(f"--tensorboard-queue-size must be >= 1, got {self.queue_size}")
        if self.log_interval < 1:
            raise ValueError(f"--tensorboard-log-interval must be >= 1, got {self.log_interval}")


@dataclass(frozen=True)
class Progress:
    """Where training stands: the x-axes of the scalars."""

    iteration: int
    consumed_samples: int
    consumed_tokens: int
    gigaflos_no_embeddings: float = 0.0


@dataclass(frozen=True)
class IterationScalars:
    """The per-iteration values (this iteration's loss, not the interval average).

    Optional values are written only when not None: ``loss_scale`` only with --fp16,
    ``params_norm`` only with --log-params-norm, ``curriculum_seqlen`` only with curriculum learning,
    ``fp8_amax_overflows`` / ``fp8_amax_underflows`` only with FP8 delayed scaling (the step's counts of
    amaxes that saturated / underflowed their scales; the recipe is in the run's config text).
    """

    learning_rate: float
    global_batch_size: int
    losses: Mapping[str, float]
    loss_scale: float | None = None
    grad_norm: float | None = None
    num_zeros: float | None = None
    params_norm: float | None = None
    curriculum_seqlen: int | None = None
    fp8_amax_overflows: int | None = None
    fp8_amax_underflows: int | None = None


def logger_settings(logging) -> tuple[TensorBoardSettings | None, WandbSettings | None]:
    """The TensorBoard and W&B settings of a config.LoggingConfig; None where that output is off."""
    wandb = None
    if logging.wandb_project:
        wandb = WandbSettings(project=logging.wandb_project, name=logging.wandb_exp_name,
                              directory=logging.wandb_save_dir)
    if not (logging.tensorboard_dir or wandb):
        return None, None
    return TensorBoardSettings(
        log_dir=logging.tensorboard_dir, queue_size=logging.tensorboard_queue_size,
        log_interval=logging.tensorboard_log_interval, log_timers=logging.log_timers_to_tensorboard,
        log_batch_size=logging.log_batch_size_to_tensorboard,
        log_learning_rate=logging.log_learning_rate_to_tensorboard,
        log_loss_scale=logging.log_loss_scale_to_tensorboard,
        log_validation_ppl=logging.log_validation_ppl_to_tensorboard), wandb


class TensorBoardLogger:
    """Writes the scalars through a SummaryWriter (with a log_dir) and a W&B run (with ``wandb``) when
    ``enabled`` (the trainer passes is_last_rank)."""

    def __init__(self, settings: TensorBoardSettings | None, enabled: bool, wandb: WandbSettings | None = None):
        self.settings = settings
        self.writer = None
        self.wandb = None
        if settings is not None and enabled and settings.log_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=settings.log_dir, max_queue=settings.queue_size)
        if settings is not None and enabled and wandb is not None:
            self.wandb = WandbRun(wandb)

    @property
    def active(self) -> bool:
        return self.writer is not None or self.wandb is not None

    def _add(self, tag: str, value: float, iteration: int):
        """``tag`` at ``iteration``, in TensorBoard and W&B."""
        if self.writer is not None:
            self.writer.add_scalar(tag, value, iteration)
        if self.wandb is not None:
            self.wandb.log(tag, value, iteration)

    def _add_with_axes(self, tag: str, value: float, progress: Progress, axes: tuple[str, ...]):
        """``tag`` against the iteration, then ``tag vs {axis}`` for each of samples/tokens/gigaflos
        (in W&B: the axis's value as ``x/{axis}`` at the iteration)."""
        self._add(tag, value, progress.iteration)
        steps = {"samples": progress.consumed_samples, "tokens": progress.consumed_tokens,
                 "gigaflos (without embeddings)": progress.gigaflos_no_embeddings}
        for axis in axes:
            if self.writer is not None:
                self.writer.add_scalar(f"{tag} vs {axis}", value, steps[axis])
            if self.wandb is not None:
                self.wandb.log_axis(axis, steps[axis], progress.iteration)

    def write_run_start(self, configuration: Mapping[str, object], iteration: int, world_size: int):
        """Every configuration value as text at ``iteration``, and the world size at ``iteration``."""
        if not self.active:
            return
        if self.writer is not None:
            for name, value in configuration.items():
                self.writer.add_text(name, str(value), global_step=iteration)
        if self.wandb is not None:
            self.wandb.update_config(configuration)
        self._add("iteration-time/world_size", world_size, iteration)

    def should_write_iteration(self, iteration: int) -> bool:
        return self.active and iteration % self.settings.log_interval == 0

    def write_iteration(self, progress: Progress, scalars: IterationScalars):
        """The per-iteration scalars, every --tensorboard-log-interval iterations."""
        if not self.should_write_iteration(progress.iteration):
            return
        it, samples, tokens = progress.iteration, progress.consumed_samples, progress.consumed_tokens
        self._add("steps-vs-samples/y=samples,x=steps", samples, it)
        self._add("steps-vs-tokens/y=tokens,x=steps", tokens, it)
        if self.writer is not None:  # their x-axis is not the iteration; W&B plots against x/samples, x/tokens
            self.writer.add_scalar("steps-vs-samples/y=steps,x=samples", it, samples)
            self.writer.add_scalar("steps-vs-tokens/y=steps,x=tokens", it, tokens)
        if self.settings.log_learning_rate:
            self._add_with_axes("learning-rate/learning-rate", scalars.learning_rate, progress,
                                ("samples", "tokens"))
        if self.settings.log_batch_size:
            self._add_with_axes("batch-size/batch-size", scalars.global_batch_size, progress, ("samples",))
        for key, value in scalars.losses.items():
            self._add_with_axes(f"lm-loss-training/{key}", value, progress,
                                ("samples", "tokens", "gigaflos (without embeddings)"))
        if self.settings.log_loss_scale and scalars.loss_scale is not None:
            self._add_with_axes("loss-scale/loss-scale", scalars.loss_scale, progress, ("samples", "tokens"))
        for tag, value in (("grad-norm/grad-norm", scalars.grad_norm), ("num-zeros/num-zeros", scalars.num_zeros),
                           ("params-norm/params-norm", scalars.params_norm)):
            if value is not None:
                self._add_with_axes(tag, value, progress, ("samples", "tokens"))
        if scalars.curriculum_seqlen is not None:
            self._add("curriculum_seqlen", scalars.curriculum_seqlen, it)
        if scalars.fp8_amax_overflows is not None:
            self._add("fp8/amax-overflows", scalars.fp8_amax_overflows, it)
            self._add("fp8/amax-underflows", scalars.fp8_amax_underflows, it)

    def write_timers(self, iteration: int, seconds_by_name: Mapping[str, float]):
        """``time/{name}-time`` for each timer, with --log-timers-to-tensorboard."""
        if not self.active or not self.settings.log_timers:
            return
        for name, seconds in seconds_by_name.items():
            self._add(f"time/{name}-time", seconds, iteration)

    def write_throughput(self, progress: Progress, throughput: Throughput):
        """The ``iteration-time/*`` scalars of a log interval, with --log-timers-to-tensorboard."""
        if not self.active or not self.settings.log_timers:
            return
        it = progress.iteration
        self._add_with_axes("iteration-time/iteration-time", throughput.iteration_time, progress,
                            ("samples", "tokens"))
        self._add("iteration-time/samples per second", throughput.samples_per_second, it)
        self._add("iteration-time/samples per second per replica",
                               throughput.samples_per_second_per_replica, it)
        self._add("iteration-time/tokens per second", throughput.tokens_per_second, it)
        self._add("iteration-time/tokens per second per replica",
                               throughput.tokens_per_second_per_replica, it)
        self._add("iteration-time/TFLOPs per gpu (estimated)", throughput.tflops, it)
        self._add("iteration-time/model TFLOP/s per gpu", throughput.model_tflops, it)
        if throughput.mfu is not None:
            self._add("iteration-time/MFU", throughput.mfu, it)

    def write_validation(self, progress: Progress, losses: Mapping[str, float], group_name: str | None = None,
                         split: str = "validation"):
        """``lm-loss-{split}[/{group}]/{key} {split}`` (+ vs samples, tokens, gigaflos), and its ppl;
        ``split`` is "validation" or "test"."""
        if not self.active:
            return
        prefix = f"lm-loss-{split}/{group_name}" if group_name else f"lm-loss-{split}"
        axes = ("samples", "tokens", "gigaflos (without embeddings)")
        for key, value in losses.items():
            self._add_with_axes(f"{prefix}/{key} {split}", value, progress, axes)
            if self.settings.log_validation_ppl:
                self._add_with_axes(f"{prefix}/{key} {split} ppl", perplexity(value), progress, axes)

    def flush(self):
        if self.writer is not None:
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.flush()

    def close(self):
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
