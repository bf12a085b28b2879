"""What the trainer sees of the engine: the TrainingEngine protocol.

One training iteration is ``train_step`` over the training iterator; evaluation is ``eval_step``;
the batch rampup calls ``set_global_batch`` before each iteration; checkpoints go through ``save`` and
``load``; the log line reads ``grad_norm``, ``loss_scale`` and ``skipped_steps``. How the engine
schedules micro batches (a pipeline of stages, or forward/backward per micro batch on one module)
is its own business: the trainer has no branch on it.
"""
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

BatchFunction = Callable[[dict], Any]  # a loader item -> the trainer's batch (data_loading.LMBatch)
# (path, the engine's own read of it) -> what the engine gets: a manifest check, a translation.
ReadFilter = Callable[[str, Callable[[], Any]], Any]


class TrainingEngine(Protocol):
    module: torch.nn.Module  # the model as the engine runs it (GPTModelPipe or GPTModel)
    reads_data: bool  # whether this rank draws batches (a pipeline's middle stages do not)
    pipeline_layout: bool  # checkpoints in layer files (layer_XX-model_YY-model_states.pt)

    def train_step(self, data_iterator: Iterator[dict], num_micro_batches: int) -> float:
        """Forward, backward and optimizer step over one global batch; the loss averaged over micro
        batches and data-parallel ranks."""

    def eval_step(self, data_iterator: Iterator[dict], num_micro_batches: int) -> float:
        """The loss of one global batch without gradients (same average)."""

    def set_global_batch(self, samples: int) -> None:
        """The global batch of the next iterations (--rampup-batch-size)."""

    def sequence_length_changed(self) -> None:
        """The batches are cut to another length from now on (curriculum learning)."""

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps not applied so far (fp16 overflow, NaN gradient)."""

    def grad_norm(self) -> float | None:
        """The last step's global gradient norm, None when not computed."""

    def loss_scale(self) -> float | None:
        """fp16's current loss scale, None without one."""

    def last_step_extras(self) -> tuple[int | None, tuple[float, str | None]]:
        """(zeros in the last step's gradient or None, the TP drift the last synchronization found)."""

    def save(self, directory: str, tag: str, client_state: dict,
             file_written: Callable[[str], None]) -> None:
        """Write this rank's files of checkpoint ``tag`` into ``directory``/``tag`` with the client
        state; ``file_written(path)`` after each file is flushed. Never writes ``latest``."""

    def load(self, directory: str, tag_directory: str, *, load_optimizer: bool, load_lr_scheduler: bool,
             read_filters: list[ReadFilter], universal: bool, megatron_deepspeed: bool) -> dict:
        """Restore ``tag_directory``, the tag ``latest`` (or ``latest_universal``) names in ``directory``;
        returns the client state. Each file read goes through ``read_filters`` (the first outermost).
        ``megatron_deepspeed``: a checkpoint of Megatron-DeepSpeed, translated while read."""

    def restart_counters(self) -> None:
        """--finetune: the engine's step and sample counters start again from 0."""
