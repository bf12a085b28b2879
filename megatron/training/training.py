"""The training loop: pretrain() sets everything up, Trainer.train() runs the iterations, then validation and test.

    pretrain(config, tokenizer)
      initialize_megatron             process group, TP/DP/PP groups, seeds          (initialize.py)
      the kill switch                 present at start: exit before building anything
      Trainer(...)                    model, optimizer, LR schedule, the engine       (engine/)
                                      --load                                          (checkpointing.py)
                                      datasets and this rank's iterators              (data_loading.py)
                                      TensorBoard, codecarbon, the matmul peak
      Trainer.train                   until --train-iters / --train-samples / --train-tokens, or an exit
      the end of training             validation, checkpoint, test, the summary

One iteration (Trainer.train):
  1. the batch calculator sets the global batch for the consumed samples (--rampup-batch-size);
     the engine follows (engine.set_global_batch);
  2. the kill switch, the exit signals and the launcher are checked in one all-reduce (any rank
     seeing the file, receiving SIGTERM / SIGINT / SIGUSR1 or finding its launcher ended stops all
     ranks, after a checkpoint: signals.py);
  3. train_step: the engine's step over one global batch (engine/interface.py); it reduces
     gradients, clips, steps the optimizer and the LR schedule (not on an fp16 overflow, which
     counts as a skipped iteration);
  4. counters advance by the global batch (samples) and global batch x seq length (tokens; with
     curriculum learning, the iteration's length, set before step 3: curriculum.py);
  5. TensorBoard scalars, the log line every --log-interval, evaluation every --eval-interval,
     a checkpoint every --save-interval;
  6. --exit-duration-in-mins (the maximum over ranks of the elapsed time) and --exit-interval stop
     the run after a checkpoint (with --save), as the kill switch does.

Reporting follows Megatron-DeepSpeed (metrics.py, tb_logger.py, docs/logging.md): the log line
(with an ETA at the end) and TensorBoard on the last rank, milestones on rank 0; at the end, a
summary of the losses and of this run's throughput. With --log-path the model's layer list goes to
a file there, the console gets one line.
"""
import contextlib
import io
import math
import os
import resource
import time
from dataclasses import dataclass

import torch

from megatron.training import dist_utils
from megatron.training.checkpointing import TrainingProgress, load_checkpoint, save_checkpoint
from megatron.training.config import TrainConfig, flat_config
from megatron.training.engine.curriculum_scheduler import SequenceLengthCurriculum
from megatron.training.data_loading import (DataLoadingError, LMBatch, LoaderSettings, batch_function, build_datasets,
                                            build_iterators, sequence_slice, train_valid_test_num_samples,
                                            truncate_batch)
from megatron.training.engine.deepspeed_engine import start_engine
from megatron.training.fp8_steps import Fp8Counts, Fp8Steps, keep_delayed_amaxes
from megatron.training.engine.model_setup import (build_lr_scheduler, build_model, build_optimizer, counts_once,
                                                  current_device, parameter_counts)
from megatron.training.initialize import check_fused_kernel_constraints, initialize_megatron
from megatron.training.log_files import write_log_file
from megatron.training.matmul_peak import measure_matmul_peak_tflops
from megatron.training.metrics import (BUILDING_DATASETS_LINE, TEST_END_PREFIX, VALIDATION_END_PREFIX,
                                       LossAccumulator, RunTotals, TrainingLogFields, datetime_line,
                                       exit_after_minutes_label, exit_at_iteration_label, initialization_time_line,
                                       kill_switch_line, memory_report_line, parameter_count_lines,
                                       rank_parameter_line, remaining_seconds, run_summary_lines,
                                       skipped_iterations_line, stop_line, train_iterations_line, training_log_line,
                                       validation_log_lines, validation_prefix)
from megatron.training.microbatches import build_num_microbatches_calculator, train_iters_for_samples
from megatron.training.profiling import IterationProfiler
from megatron.training.signals import ExitSignals, signal_name
from megatron.training.throughput import compute_throughput, gigaflos_no_embeddings, model_flops
from megatron.training.tb_logger import IterationScalars, Progress, TensorBoardLogger, logger_settings
from megatron.training.timers import Timers

LOSS_KEY = "lm loss"
BILLION = 1e9
SETUP_MOMENT = "after model, optimizer, and learning rate scheduler are built"


class TrainingDivergedError(RuntimeError):
    """Too many iterations in a row had a NaN or Inf loss or gradient norm (--max-consecutive-nan-iterations)."""


@dataclass(frozen=True)
class StepResult:
    """One iteration: the loss (mean over micro batches and data-parallel ranks; None when the
    iteration was skipped by --skip-train-iteration-range), whether no update was applied (an fp16
    overflow, a NaN/Inf gradient, a skip range), and DeepSpeed's global gradient norm (None when not
    computed); with FP8 delayed scaling, the step's amax overflow / underflow counts."""

    loss: float | None
    skipped: bool
    grad_norm: float | None
    num_zeros: int | None = None
    fp8: Fp8Counts | None = None

    def is_nan(self, fp16: bool) -> bool:
        """A skipped step with a NaN/Inf loss, or (outside fp16, whose loss scaling overflows on
        purpose) with a NaN/Inf gradient norm."""
        def bad(value):
            return value is not None and not math.isfinite(value)
        return self.skipped and (bad(self.loss) or (not fp16 and bad(self.grad_norm)))


def in_ranges(iteration: int, ranges: tuple[tuple[int, int], ...]) -> tuple[int, int] | None:
    """The range of ``ranges`` that holds ``iteration``, or None."""
    return next(((start, end) for start, end in ranges if start <= iteration <= end), None)


def total_train_iters(config: TrainConfig) -> int:
    """--train-iters, or the iterations --train-samples takes (rampup included, the last partial batch dropped)."""
    schedule = config.schedule
    if schedule.train_iters is not None:
        return schedule.train_iters
    return train_iters_for_samples(schedule.train_samples, schedule.global_batch_size, schedule.micro_batch_size,
                                   config.parallel.data_shard_size, schedule.rampup_batch_size)


def exit_label(iteration: int, elapsed_minutes: float | None, schedule) -> str | None:
    """Megatron-DeepSpeed's exit message when --exit-duration-in-mins has passed (``elapsed_minutes``, the maximum
    over ranks) or ``iteration`` is a multiple of --exit-interval; None to go on."""
    if schedule.exit_duration_in_mins is not None and elapsed_minutes > schedule.exit_duration_in_mins:
        return exit_after_minutes_label(elapsed_minutes)
    if schedule.exit_interval is not None and iteration % schedule.exit_interval == 0:
        return exit_at_iteration_label(iteration)
    return None


@dataclass(frozen=True)
class StopRequest:
    """Why the run must stop now, as every rank agreed: the kill switch, a signal (its number, 0 for
    none), or a rank's launcher that has ended."""

    kill_switch: bool
    signal_number: int
    launcher_gone: bool = False

    @property
    def stops(self) -> bool:
        return self.kill_switch or bool(self.signal_number) or self.launcher_gone


def stop_request(kill_switch_path: str | None, signals: ExitSignals) -> StopRequest:
    """Collective, one all-reduce: whether any rank sees the --kill-switch-path file (whichever file
    system sees it first), the largest exit signal any rank received, and whether any rank's
    launcher has ended (signals.py)."""
    seen = kill_switch_path is not None and os.path.exists(kill_switch_path)
    gone = signals.launcher is not None and signals.launcher.gone()
    kill_switch, number, launcher_gone = dist_utils.max_each_across_ranks([float(seen), float(signals.first),
                                                                           float(gone)])
    return StopRequest(kill_switch > 0, int(number), launcher_gone > 0)


def peak_memory_megabytes(device: torch.device) -> float:
    """The peak the memory line reports first: CUDA's max allocated, or on CPU the peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # kilobytes on Linux


class Trainer:
    """The engine, the data, the reporting and the counters of one run, all built by the constructor
    (module docstring); ``train`` runs the loop."""

    def __init__(self, config: TrainConfig, groups, tokenizer, start_time: float, signals: ExitSignals):
        self.config, self.groups, self.schedule = config, groups, config.schedule
        self.start_time, self.signals = start_time, signals
        self.timers = Timers()
        self.train_iters = total_train_iters(config)
        self.dp_group = groups.process_groups["dp"]
        self.fp8_steps = None if config.model.fp8 is None else Fp8Steps(
            config.model.fp8, [groups.process_groups["tp"], self.dp_group])
        self.calculator = build_num_microbatches_calculator(
            self.schedule.global_batch_size, self.schedule.micro_batch_size, groups.data_shard_size,
            self.schedule.rampup_batch_size)
        self.device = current_device()
        self.make_batch = batch_function(tokenizer.eod, config.data, self.device, config.model.padded_vocab_size)
        self.curriculum = SequenceLengthCurriculum(self.schedule.curriculum) if self.schedule.curriculum else None
        self.active_seq_length = config.model.seq_length  # what the batches are cut to (curriculum.py)
        self.last_saved_iteration = None
        self.memory_reported = False
        self.accumulator = LossAccumulator()
        self.consecutive_nan_iterations = 0
        self.totals = RunTotals()
        self.summary_losses: dict[str, float] = {}
        self.progress = TrainingProgress()
        dist_utils.print_rank_0(train_iterations_line(self.train_iters))
        model = self._build_model()
        self.parameters_without_embeddings_billions = self._report_parameter_counts(model)
        self.lr_scheduler, self.engine = self._build_engine(model)
        loaded = load_checkpoint(self.engine, config)
        if loaded is not None:
            # The loaded iteration is on disk already: saving it again would rewrite the files ``latest`` names.
            self.progress = loaded
            self.last_saved_iteration = None if config.checkpoint.finetune else loaded.iteration
            if self.curriculum is not None and loaded.curriculum_seqlen is not None:
                self.curriculum.restore(loaded.curriculum_seqlen)
        self.calculator.update(self.progress.consumed_train_samples)
        self.first_iteration = self.progress.iteration + 1
        dist_utils.print_rank_0(datetime_line(SETUP_MOMENT))
        if self.device.type == "cuda":  # the set-up's own peak, apart from the training's (the GPU's allocator only)
            self._report_memory(self.progress.iteration, SETUP_MOMENT)
        self.named_sets = not config.data.dataset.data_path
        self.iterators = self._build_data()
        try:
            dist_utils.print_rank_0(datetime_line("after dataloaders are built"))
            self.tensorboard, self.emissions = self._build_reporting()
            self.peak_tflops = measure_matmul_peak_tflops(self.device) if self.device.type == "cuda" else None
            self.profiler = IterationProfiler(config.profile, dist_utils.rank(), self.device)
        except BaseException:
            self.iterators.close()  # the loaders' workers end now: nothing else will close them
            raise

    # ------------------------------------------------------------------ set-up

    def _build_model(self):
        """The model; with --log-path, the layer list DeepSpeed prints while partitioning the pipeline
        goes to a file there, with the module tree, and the console gets one line."""
        log_path = self.config.logging.log_path
        if not log_path or not dist_utils.is_rank_0():
            return build_model(self.config, self.groups)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            model = build_model(self.config, self.groups)
        path = write_log_file(log_path, "model", printed.getvalue() + "\n" + repr(model) + "\n")
        dist_utils.print_line(f"> model: {type(model).__name__} in {self.groups.pp_size} pipeline stage(s); "
                              f"layer list and partition in {path}")
        return model

    def _report_parameter_counts(self, model) -> float:
        """Print the parameter counts (whole model, and per TP/PP rank); return billions without embeddings."""
        held, held_without_embeddings = parameter_counts(model)
        share = parameter_counts(model, distinct_for=self.groups)
        total, without_embeddings = (value / self.groups.dp_size for value in dist_utils.sum_across_group(share))
        for line in parameter_count_lines(total / BILLION, without_embeddings / BILLION):
            dist_utils.print_rank_0(line)
        if self.groups.dp_rank == 0:
            dist_utils.print_line(rank_parameter_line(self.groups.tp_rank, self.groups.pp_rank, held / BILLION,
                                                      held_without_embeddings / BILLION))
        return without_embeddings / BILLION

    def _build_engine(self, model):
        optimizer = build_optimizer(model, self.config.optimizer, self.config.deepspeed.offloads_optimizer)
        lr_scheduler = build_lr_scheduler(optimizer, self.config.optimizer, self.schedule,
                                          self.calculator.get_current_global_batch_size,
                                          lambda: self.progress.consumed_train_tokens)
        return lr_scheduler, start_engine(self.config, self.groups, model, optimizer, lr_scheduler, self._batch)

    def _build_data(self):
        schedule, data = self.schedule, self.config.data
        dist_utils.print_rank_0(BUILDING_DATASETS_LINE)
        num_samples = train_valid_test_num_samples(self.train_iters, schedule.global_batch_size,
                                                   schedule.train_samples, schedule.eval_interval, schedule.eval_iters)
        if schedule.eval_iters == 0:
            num_samples = (num_samples[0], 0, 0)
        datasets = build_datasets(data, num_samples)
        if datasets.train is None and not schedule.eval_only:
            raise DataLoadingError("no training samples: the train split holds no documents (see --split or "
                                   "--train-weighted-split-paths)")
        groups = self.groups
        settings = dict(micro_batch_size=schedule.micro_batch_size, data_parallel_rank=groups.data_shard_rank,
                        data_parallel_size=groups.data_shard_size, seed=self.config.model.seed,
                        dataloader_type=data.dataloader_type)
        return build_iterators(datasets, self.engine.reads_data, LoaderSettings(num_workers=data.num_workers, **settings),
                               LoaderSettings(num_workers=data.valid_num_workers, **settings),
                               self.progress.consumed_train_samples, self.progress.consumed_valid_samples)

    def _build_reporting(self):
        """(TensorBoard and W&B logger, codecarbon tracker or None)."""
        logging = self.config.logging
        settings, wandb = logger_settings(logging)
        tensorboard = TensorBoardLogger(settings, enabled=dist_utils.is_last_rank(), wandb=wandb)
        tensorboard.write_run_start(flat_config(self.config), self.progress.iteration, dist_utils.world_size())
        emissions = None
        if logging.codecarbon_dir:
            from megatron.training.emissions import EmissionsTracker
            emissions = EmissionsTracker(logging.codecarbon_dir, dist_utils.rank())
            emissions.start()
        return tensorboard, emissions

    # ------------------------------------------------------------------ one iteration

    def _skip_step(self) -> StepResult:
        """--skip-train-iteration-range: draw this iteration's whole global batch and discard it; no
        forward, no update, no learning-rate step (as an iteration skipped for NaN)."""
        if self.iterators.train is not None:
            for _ in range(self.calculator.get()):
                next(self.iterators.train)
        return StepResult(loss=None, skipped=True, grad_norm=None)

    def _next_step(self) -> StepResult:
        iteration = self.progress.iteration + 1
        skip_range = in_ranges(iteration, self.schedule.skip_train_iteration_ranges)
        if skip_range is None:
            return self.train_step()
        if iteration == skip_range[0] or iteration == self.first_iteration:
            dist_utils.print_rank_0(skipped_iterations_line(iteration, skip_range[1]))
        return self._skip_step()

    def _count_nan(self, result: StepResult) -> None:
        """Stop, after a checkpoint, once --max-consecutive-nan-iterations NaN/Inf iterations came in a row."""
        if result.loss is None:  # a skip range neither continues nor ends a run of NaN iterations
            return
        nan = result.is_nan(self.config.precision.fp16)
        self.consecutive_nan_iterations = self.consecutive_nan_iterations + 1 if nan else 0
        limit = self.schedule.max_consecutive_nan_iterations
        if limit and self.consecutive_nan_iterations >= limit:
            self._save_before_exit()
            saved = f"; the checkpoint at iteration {self.progress.iteration} holds the weights from before them" \
                if self.config.checkpoint.save else ""
            raise TrainingDivergedError(
                f"{self.consecutive_nan_iterations} iterations in a row (up to {self.progress.iteration}) had a NaN or "
                f"Inf loss or gradient norm and made no update (--max-consecutive-nan-iterations {limit}){saved}. "
                f"Roll back to an earlier checkpoint, lower the learning rate (--override-lr-scheduler) or skip the "
                f"data (--skip-train-iteration-range)")

    def train_step(self) -> StepResult:
        skipped_before = self.engine.skipped_steps
        loss = self.engine.train_step(self.iterators.train, self.calculator.get())
        fp8 = None if self.fp8_steps is None else self.fp8_steps.end_step(self.engine.module)
        num_zeros, (drift, name) = self.engine.last_step_extras()
        self._report_tp_drift(drift, name)
        return StepResult(loss, self.engine.skipped_steps > skipped_before, self.engine.grad_norm(), num_zeros, fp8)

    def _report_tp_drift(self, drift: float, name: str | None):
        """--sync-tp-duplicated-parameters: name the drift the step's synchronization found, if any."""
        if drift > 0.0:
            dist_utils.print_rank_0(f"> iteration {self.progress.iteration + 1}: TP-duplicated parameters had drifted "
                                    f"apart (largest |difference| {drift:.3e}, in {name}); synchronized from "
                                    f"tensor-parallel rank 0")

    def _batch(self, data: dict) -> LMBatch:
        """A loader item as a batch on the device, cut to the active length (curriculum.py), of which a
        DeepSpeed-Ulysses rank keeps its slice of positions."""
        batch = truncate_batch(self.make_batch(data), self.active_seq_length)
        return sequence_slice(batch, self.groups.sp_rank, self.groups.sp_size)

    def _use_length(self, seq_length: int) -> None:
        """Cut the next batches to ``seq_length``; the engine is told (a pipeline re-learns its activation shapes)."""
        if seq_length != self.active_seq_length:
            self.active_seq_length = seq_length
            self.engine.sequence_length_changed()

    def _eval_step(self, iterator) -> float:
        """The loss of one global batch, without gradients (mean over micro batches and DP ranks)."""
        return self.engine.eval_step(iterator, self.calculator.get())

    def _advance(self):
        """Counters after an iteration: tokens at the curriculum's length, Megatron-DeepSpeed's gigaflos at
        the full length."""
        batch = self.calculator.get_current_global_batch_size()
        seq_length = self.active_seq_length
        progress = self.progress
        progress.iteration += 1
        progress.consumed_train_samples += batch
        progress.consumed_train_tokens += batch * seq_length
        progress.gigaflos_no_embeddings += gigaflos_no_embeddings(batch, self.config.model.seq_length,
                                                                  self.parameters_without_embeddings_billions)
        self.totals.add_iteration(batch, batch * seq_length, model_flops(self.config.model, batch, seq_length))

    # ------------------------------------------------------------------ the loop

    def training_done(self) -> bool:
        tokens = self.schedule.train_tokens
        return self.progress.iteration >= self.train_iters or (
            tokens is not None and self.progress.consumed_train_tokens >= tokens)

    def train(self) -> str | None:
        """Iterate until done; returns the exit line when --exit-*/--kill-switch-path stopped the run."""
        self.timers("interval-time").start()
        try:
            return self._iterate()
        finally:
            self.profiler.close()
            timer = self.timers("interval-time")
            seconds = timer.elapsed()
            # After the last log line only logging, evaluation and saving ran: not iteration time.
            if self.accumulator.total_iterations:
                self.totals.seconds += seconds
            if timer.running:
                timer.stop()

    def _iterate(self) -> str | None:
        while not self.training_done():
            self.calculator.update(self.progress.consumed_train_samples)
            self.engine.set_global_batch(self.calculator.get_current_global_batch_size())
            stop = stop_request(self.schedule.kill_switch_path, self.signals)
            if stop.stops:
                self._save_before_exit()
                return self._stop_line(stop)
            if self.curriculum is not None:
                self._use_length(self.curriculum.length_for(self.progress.iteration + 1))
                self.progress.curriculum_seqlen = self.active_seq_length
            with self.profiler.iteration(self.progress.iteration + 1):
                self.timers("train-step").start()
                result = self._next_step()
                self.timers("train-step").stop()
            self._advance()
            self._report(result)
            self._count_nan(result)
            iteration = self.progress.iteration
            if self.do_valid and iteration % self.schedule.eval_interval == 0:
                self._paused(self.evaluate_and_print, self.iterators.valid, validation_prefix(iteration), "validation")
            if self.config.checkpoint.save_due(iteration):
                self._paused(self.save)
            label = self._exit_requested()
            if label is not None:
                self._save_before_exit()
                return datetime_line(label)
        return None

    def _paused(self, function, *args):
        """Run ``function`` with the interval timer stopped, so evaluation and saving do not count
        as iteration time."""
        self.timers("interval-time").stop()
        function(*args)
        self.timers("interval-time").start()

    def _stop_line(self, stop: StopRequest) -> str:
        if stop.kill_switch:
            return kill_switch_line(self.schedule.kill_switch_path)
        if stop.signal_number:
            return stop_line(f"received {signal_name(stop.signal_number)}", self.progress.iteration,
                             self.config.checkpoint.save)
        watch = self.signals.launcher
        seen_here = watch is not None and watch.gone()
        description = watch.description() if seen_here else "the launcher of another rank has ended"
        return stop_line(description, self.progress.iteration, self.config.checkpoint.save)

    def _exit_requested(self) -> str | None:
        elapsed = None
        if self.schedule.exit_duration_in_mins is not None:
            elapsed = dist_utils.max_across_ranks((time.time() - self.start_time) / 60.0)
        return exit_label(self.progress.iteration, elapsed, self.schedule)

    def _save_before_exit(self):
        if self.config.checkpoint.save and self.last_saved_iteration != self.progress.iteration:
            self._paused(self.save)
        dist_utils.barrier()

    def save(self):
        self.timers("save-checkpoint").start()
        save_checkpoint(self.engine, self.progress, self.config)
        self.timers("save-checkpoint").stop()
        self.last_saved_iteration = self.progress.iteration
        if self.emissions is not None:
            self.emissions.flush()

    # ------------------------------------------------------------------ reporting

    @property
    def do_valid(self) -> bool:
        return self.schedule.eval_iters > 0 and bool(self.iterators.valid)

    def _report(self, result: StepResult):
        losses = {} if result.loss is None else {LOSS_KEY: result.loss}
        self.accumulator.add(losses, result.skipped, result.is_nan(self.config.precision.fp16))
        params_norm = None
        if self.config.logging.log_params_norm:
            params_norm = dist_utils.params_l2_norm(self.engine.module.named_parameters(), self.groups.tp_rank,
                                                    self.groups.dp_size, lambda name: counts_once(name, self.groups))
        loss_scale = self.engine.loss_scale() if self.config.precision.fp16 else None
        scalars = IterationScalars(learning_rate=self.lr_scheduler.get_lr(),
                                   global_batch_size=self.calculator.get_current_global_batch_size(),
                                   losses=losses, loss_scale=loss_scale, grad_norm=result.grad_norm,
                                   num_zeros=result.num_zeros, params_norm=params_norm,
                                   curriculum_seqlen=self.active_seq_length if self.curriculum else None,
                                   fp8_amax_overflows=None if result.fp8 is None else result.fp8.overflows,
                                   fp8_amax_underflows=None if result.fp8 is None else result.fp8.underflows)
        self.tensorboard.write_iteration(self._tensorboard_progress(), scalars)
        if self.progress.iteration % self.schedule.log_interval == 0:
            self._log_interval(scalars)

    def _tensorboard_progress(self) -> Progress:
        p = self.progress
        return Progress(p.iteration, p.consumed_train_samples, p.consumed_train_tokens, p.gigaflos_no_embeddings)

    def _log_interval(self, scalars: IterationScalars):
        iterations = max(1, self.accumulator.total_iterations)
        interval_seconds = self.timers("interval-time").elapsed()
        self.totals.seconds += interval_seconds
        iteration_time = interval_seconds / iterations
        seq_length = self.active_seq_length
        throughput = compute_throughput(self.config.model, global_batch_size=scalars.global_batch_size,
                                        seq_length=seq_length, iteration_time=iteration_time,
                                        world_size=dist_utils.world_size(),
                                        data_parallel_size=self.groups.data_shard_size, peak_tflops=self.peak_tflops,
                                        pipeline_model_parallel_size=self.config.parallel.pipeline_model_parallel_size)
        p = self.progress
        eta = remaining_seconds(p.iteration, self.train_iters, p.consumed_train_tokens, self.schedule.train_tokens,
                                scalars.global_batch_size * seq_length, iteration_time)
        losses = self.accumulator.averages()
        quantization, fp8 = self.fp8_steps.interval_fields() if self.fp8_steps else (None, None)
        self.summary_losses.update({f"train {key}": value for key, value in losses.items()})
        fields = TrainingLogFields(
            iteration=p.iteration, train_iters=self.train_iters, consumed_samples=p.consumed_train_samples,
            consumed_tokens=p.consumed_train_tokens, elapsed_time_per_iteration=iteration_time,
            learning_rate=scalars.learning_rate, global_batch_size=scalars.global_batch_size,
            skipped_iterations=self.accumulator.skipped_iterations, nan_iterations=self.accumulator.nan_iterations,
            samples_per_second=throughput.samples_per_second, tflops=throughput.tflops, losses=losses,
            loss_scale=scalars.loss_scale, grad_norm=scalars.grad_norm, num_zeros=scalars.num_zeros,
            params_norm=scalars.params_norm, curriculum_seqlen=scalars.curriculum_seqlen,
            model_tflops=throughput.model_tflops, mfu=throughput.mfu, eta_seconds=eta, quantization=quantization,
            amax_overflows=None if fp8 is None else fp8.overflows,
            amax_underflows=None if fp8 is None else fp8.underflows)
        dist_utils.print_rank_last(training_log_line(fields))
        self.tensorboard.write_throughput(self._tensorboard_progress(), throughput)
        self.timers.write(self.timers.existing(("train-step", "save-checkpoint", "evaluate")), self.tensorboard,
                          p.iteration, normalizer=iterations, reset=True)
        self.accumulator.reset()
        if not self.memory_reported:
            self.memory_reported = True
            self._report_memory(p.iteration)

    def _report_memory(self, iteration: int, moment: str | None = None):
        """Collective. Rank 0 prints the memory line of the rank that used the most (ranks of DP index
        0 compete: their replicas use what theirs do), with how many ranks were compared."""
        entry = None
        if self.groups.dp_rank == 0:
            entry = (peak_memory_megabytes(self.device),
                     memory_report_line(dist_utils.rank(), iteration, self.device, moment))
        entries = [found for found in dist_utils.gather_objects(entry) if found is not None]
        line = max(entries)[1]
        if len(entries) > 1:
            line += f" | the largest of {len(entries)} ranks"
        dist_utils.print_rank_0(line)

    def evaluate(self, iterator) -> float:
        """Mean loss over --eval-iters global batches at the full sequence length (the curriculum's
        length is back for the next training iteration)."""
        training_length = self.active_seq_length
        self._use_length(self.config.model.seq_length)
        with keep_delayed_amaxes(self.engine.module) if self.fp8_steps else contextlib.nullcontext():
            losses = [self._eval_step(iterator) for _ in range(self.schedule.eval_iters)]
        self._use_length(training_length)
        return sum(losses) / len(losses)

    def evaluate_and_print(self, named_iterators, prefix: str, split: str):
        """Every set of ``named_iterators`` (``split``: "validation" or "test"): Megatron-DeepSpeed's
        three lines and the TensorBoard scalars; the losses are kept for the summary."""
        self.timers("evaluate").start()
        for name, iterator in named_iterators:
            losses = {LOSS_KEY: self.evaluate(iterator)}
            group_name = name if self.named_sets else None
            dist_utils.print_rank_last("\n".join(validation_log_lines(prefix, losses, group_name)))  # one write
            self.tensorboard.write_validation(self._tensorboard_progress(), losses, group_name, split)
            label = f"{split} {group_name}" if group_name else split
            self.summary_losses.update({f"{label} {key}": value for key, value in losses.items()})
        if split == "validation":
            self.progress.consumed_valid_samples += (self.schedule.eval_iters *
                                                     self.calculator.get_current_global_batch_size())
        self.timers("evaluate").stop()

    def print_summary(self):
        p = self.progress
        for line in run_summary_lines(self.totals, p.iteration, p.consumed_train_samples, p.consumed_train_tokens,
                                      self.summary_losses, dist_utils.world_size(), self.peak_tflops):
            dist_utils.print_rank_last(line)

    def finish(self):
        self.iterators.close()
        self.tensorboard.close()
        if self.emissions is not None:
            self.emissions.stop()


def _run(trainer: Trainer) -> None:
    """Train, then evaluate on validation, save and test as Megatron-DeepSpeed does at the end of
    training; then the summary."""
    config = trainer.config
    if not config.schedule.eval_only:
        dist_utils.print_rank_0("training ...")
        exit_line = trainer.train()
        dist_utils.print_rank_0(datetime_line("after training is done"))
        if exit_line is not None:
            dist_utils.print_rank_0(exit_line)
            trainer.print_summary()
            return
    if trainer.do_valid:
        prefix = VALIDATION_END_PREFIX if not config.schedule.eval_only else validation_prefix(trainer.progress.iteration)
        trainer.evaluate_and_print(trainer.iterators.valid, prefix, "validation")
    if config.checkpoint.save and trainer.progress.iteration > 0 and \
            trainer.last_saved_iteration != trainer.progress.iteration and not config.schedule.eval_only:
        trainer.save()
    if config.schedule.eval_iters > 0 and trainer.iterators.test:
        trainer.evaluate_and_print(trainer.iterators.test, TEST_END_PREFIX, "test")
    trainer.print_summary()


def pretrain(config: TrainConfig, tokenizer) -> TrainingProgress:
    """Run the whole job (module docstring); returns where training stands at the end.

    ``tokenizer`` provides ``eod``.
    """
    start_time = time.time()
    with ExitSignals() as signals:
        groups = initialize_megatron(config.parallel, config.logging, config.model.seed)
        if config.abort_on_unmet_fused_kernel_constraints:
            check_fused_kernel_constraints(config.model, groups.tp_size, config.schedule.micro_batch_size)
        start_time = -dist_utils.max_across_ranks(-start_time)
        dist_utils.print_rank_0(initialization_time_line(time.time() - start_time))
        dist_utils.print_rank_0(datetime_line("after megatron is initialized"))
        if stop_request(config.schedule.kill_switch_path, signals).kill_switch:
            dist_utils.print_rank_0(kill_switch_line(config.schedule.kill_switch_path))
            dist_utils.shutdown()
            return TrainingProgress()
        trainer = Trainer(config, groups, tokenizer, start_time, signals)
        try:
            _run(trainer)
        finally:
            trainer.finish()
        dist_utils.shutdown()
    return trainer.progress
