"""From the dataset description to batches on the device: datasets, samplers, loaders, the batch function.

Who reads data. Every rank builds the same datasets (the index caches are built once, by global
rank 0, and memory-mapped by all), since their samples are a pure function of --seed, the data and
the counts. The ranks that consume tokens then read them themselves: with the pipeline engine the
first stage (inputs) and the last stage (labels), with the plain engine every rank; middle pipeline
stages build no loader and read nothing. All TP ranks of a stage share the DP rank, hence the
sampler, hence the batch: the same batch without a broadcast. So do the S ranks of a DeepSpeed-Ulysses
group (--ds-sequence-parallel-size): their samplers use the data-parallel rank and size of the sample
streams (ParallelGroups.data_shard_rank / data_shard_size), and each rank keeps its 1 / S of
the positions (``sequence_slice``).

Samplers (megatron.core.data.samplers) start at the consumed samples, so a resumed run reads
exactly the batches the uninterrupted run would have read next. ``--dataloader-type single`` reads
the training samples in order (the dataset's shuffle index provides the randomness); ``cyclic``
reshuffles every epoch and cycles. Validation and test iterators always cycle: a ``single``
loader that runs out starts again at sample 0, so more evaluations than planned (a resumed run,
the final evaluation) never stop training.

Batches: a sample holds s + 1 tokens; tokens = text[:, :-1], labels = text[:, 1:]; loss mask,
position ids and the optional attention mask come from get_ltor_masks_and_position_ids with
--eod-mask-loss / --reset-position-ids / --reset-attention-mask, computed on the device.
"""
import multiprocessing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.utils.data import DataLoader

from megatron.core.data.builders import TrainValidTestDatasets, build_train_valid_test_datasets
from megatron.core.data.gpt_dataset import GPTDatasetConfig
from megatron.core.data.indexed_dataset import IndexedDatasetError, check_dataset_prefix
from megatron.core.data.samplers import MegatronPretrainingRandomSampler, MegatronPretrainingSampler
from megatron.core.models.gpt import get_ltor_masks_and_position_ids
from megatron.core.tensor_parallel.layers import check_token_ids
from megatron.training.argument_types import ArgumentError
from megatron.training.config import DataConfig
from megatron.training.signals import end_worker_processes_at_exit, ignore_exit_signals

DATALOADER_TYPES = ("single", "cyclic")


class DataLoadingError(RuntimeError):
    """The data cannot provide what training asks for (too few samples, exhausted training data)."""


def train_valid_test_num_samples(train_iters: int, global_batch_size: int, train_samples: int | None,
                                 eval_interval: int, eval_iters: int) -> tuple[int, int, int]:
    """Samples to build per split, as Megatron-DeepSpeed asks for them.

    train: --train-samples, or train_iters x global batch; valid: one evaluation of eval_iters
    global batches every eval_interval iterations plus the final one; test: one evaluation.
    """
    train = train_samples if train_samples is not None else train_iters * global_batch_size
    evaluations = train_iters // eval_interval + 1
    return train, evaluations * eval_iters * global_batch_size, eval_iters * global_batch_size


class LMBatch(NamedTuple):
    """One micro batch on the device: tokens, labels, loss_mask, position_ids [b, s];
    attention_mask bool [b, 1, s, s] (True = masked) or None for plain causal attention."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None


def get_batch(data: dict, eod_token: int, data_config: DataConfig, device: torch.device,
              vocab_size: int | None = None) -> LMBatch:
    """The LM batch of a loader item ``{"text": int64 [b, s + 1]}`` (see the module docstring).
    Given ``vocab_size`` (the padded vocabulary), token ids outside [0, vocab_size) raise ValueError,
    checked on the loader's CPU tensor, before the copy to ``device`` (no device read-back)."""
    if vocab_size is not None:
        check_token_ids(data["text"], vocab_size)
    text = data["text"].to(device, non_blocking=True).long()  # [b, s + 1]
    tokens = text[:, :-1].contiguous()  # [b, s]
    labels = text[:, 1:].contiguous()  # [b, s]
    masks = get_ltor_masks_and_position_ids(tokens, eod_token, reset_position_ids=data_config.reset_position_ids,
                                            reset_attention_mask=data_config.reset_attention_mask,
                                            eod_mask_loss=data_config.eod_mask_loss)
    return LMBatch(tokens, labels, masks.loss_mask, masks.position_ids, masks.attention_mask)


def truncate_batch(batch: LMBatch, seq_length: int) -> LMBatch:
    """The batch cut to its first ``seq_length`` positions (curriculum learning): [b, s] -> [b, L],
    the attention mask [b, 1, s, s] -> [b, 1, L, L]. Causal masks, labels and position ids of the
    first L positions depend on those positions only, so the cut equals a batch of L tokens."""
    if seq_length >= batch.tokens.shape[1]:
        return batch
    mask = batch.attention_mask
    return LMBatch(*(tensor[:, :seq_length].contiguous() for tensor in batch[:4]),
                   None if mask is None else mask[:, :, :seq_length, :seq_length].contiguous())


def sequence_slice(batch: LMBatch, rank: int, size: int) -> LMBatch:
    """DeepSpeed-Ulysses: rank r of ``size`` S keeps positions [r s / S, (r + 1) s / S) of tokens,
    labels, loss mask and position ids (which keep their values: the global positions); the
    attention mask, read after attention's all-to-all over the whole sequence, stays whole."""
    if size == 1:
        return batch
    seq_length = batch.tokens.shape[1]
    if seq_length % size != 0:
        raise ValueError(f"a batch of {seq_length} positions cannot be split over --ds-sequence-parallel-size "
                         f"{size}: the sequence length must be a multiple of it")
    block = seq_length // size
    return LMBatch(*(tensor[:, rank * block:(rank + 1) * block].contiguous() for tensor in batch[:4]),
                   batch.attention_mask)


def pipeline_batch(batch: LMBatch) -> tuple[tuple, tuple]:
    """The GPTModelPipe layout: inputs (tokens, position_ids[, attention_mask]), labels (labels, loss_mask)."""
    inputs = (batch.tokens, batch.position_ids)
    if batch.attention_mask is not None:
        inputs += (batch.attention_mask,)
    return inputs, (batch.labels, batch.loss_mask)


def batch_function(eod_token: int, data_config: DataConfig, device: torch.device,
                   vocab_size: int) -> Callable[[dict], LMBatch]:
    """``data -> LMBatch`` with the tokenizer's EOD, the mask flags and the padded vocabulary bound."""

    def make_batch(data: dict) -> LMBatch:
        return get_batch(data, eod_token, data_config, device, vocab_size)

    return make_batch


# Workers forked from the trainer itself would keep, copy-on-write, every page of host memory it held
# when they started (under CPU offload, the optimizer states): the trainer rewrites them each step, so
# each page then exists twice. A fork server, a fresh interpreter started on first use, forks them
# instead; the datasets reach them pickled (their index arrays re-mapped from their cache files).
WORKER_START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else None


@dataclass
class LoaderSettings:
    """How one split is read: sampler kind, micro batch, this rank's DP coordinates, workers, seed."""

    dataloader_type: str
    micro_batch_size: int
    data_parallel_rank: int
    data_parallel_size: int
    num_workers: int
    seed: int

    def __post_init__(self):
        if self.dataloader_type not in DATALOADER_TYPES:
            raise ValueError(f"--dataloader-type {self.dataloader_type!r}: use one of {DATALOADER_TYPES}")


def build_data_loader(dataset, consumed_samples: int, settings: LoaderSettings) -> DataLoader:
    """A DataLoader whose batch sampler yields this DP rank's micro batches from ``consumed_samples`` on."""
    common = dict(total_samples=len(dataset), consumed_samples=consumed_samples,
                  micro_batch_size=settings.micro_batch_size, data_parallel_rank=settings.data_parallel_rank,
                  data_parallel_size=settings.data_parallel_size)
    if settings.dataloader_type == "single":
        sampler = MegatronPretrainingSampler(**common)
    else:
        sampler = MegatronPretrainingRandomSampler(**common, seed=settings.seed)
    # A private generator seeds the workers: drawing from the default one would shift the dropout
    # masks of a resumed run, whose loaders start at another point of the RNG stream.
    generator = torch.Generator().manual_seed(settings.seed)
    workers = {}
    if settings.num_workers > 0:
        end_worker_processes_at_exit()
        workers = dict(persistent_workers=True, worker_init_fn=ignore_exit_signals,
                       multiprocessing_context=WORKER_START_METHOD)
    return DataLoader(dataset, batch_sampler=sampler, num_workers=settings.num_workers, generator=generator,
                      pin_memory=torch.cuda.is_available(), **workers)


class LoaderBatches:
    """The batches of one split, from ``consumed_samples`` on, read through DataLoaders this object
    owns. ``cycle``: a cyclic loader goes on to its next epoch, a single loader starts again at sample
    0 (consumed counts beyond the dataset wrap around); otherwise the data ends with DataLoadingError.

    ``close()`` drops every loader this object made, which shuts its worker processes down. Nothing
    else may hold them: the workers ignore the exit signals (signals.py), so a worker left to garbage
    collection would outlive the interpreter's exit, whose terminate() it ignores, and is killed
    there (signals.end_worker_processes) without a clean shutdown.
    (A generator kept its closed frame's loader alive on one Python build; hence a plain object.)
    """

    def __init__(self, dataset, consumed_samples: int, settings: LoaderSettings, name: str, cycle: bool):
        self.dataset, self.settings, self.name, self.cycle = dataset, settings, name, cycle
        if cycle and settings.dataloader_type == "single":
            consumed_samples %= len(dataset)
        self._loader: DataLoader | None = None
        self._batches: Iterator[dict] | None = None
        self._served_this_epoch = 0
        if consumed_samples < len(dataset) or settings.dataloader_type == "cyclic":
            self._start_epoch(consumed_samples)

    def __iter__(self) -> "LoaderBatches":
        return self

    def __next__(self) -> dict:
        while True:
            if self._batches is None:
                raise self._exhausted()
            batch = next(self._batches, None)
            if batch is not None:
                self._served_this_epoch += 1
                return batch
            self._end_epoch()

    def _start_epoch(self, start: int) -> None:
        self._batches = None  # the previous loader's workers end before the next loader starts its own
        if self._loader is None or self.settings.dataloader_type == "single":
            self._loader = None
            self._loader = build_data_loader(self.dataset, start, self.settings)
        self._batches = iter(self._loader)
        self._served_this_epoch = 0

    def _end_epoch(self) -> None:
        if not self.cycle:
            self.close()
            return
        if self._served_this_epoch == 0:
            raise DataLoadingError(f"{self.name} dataset ({len(self.dataset)} samples) holds less than one micro "
                                   f"batch per data-parallel rank ({self.settings.micro_batch_size} x "
                                   f"{self.settings.data_parallel_size}); give it more samples")
        self._start_epoch(0)

    def _exhausted(self) -> DataLoadingError:
        return DataLoadingError(f"the {self.name} data is exhausted: {len(self.dataset)} samples, all consumed; the "
                                f"run asks for more samples than were built (--train-samples / --train-iters)")

    def close(self) -> None:
        self._batches = None
        self._loader = None


def cycling_iterator(dataset, consumed_samples: int, settings: LoaderSettings, name: str) -> LoaderBatches:
    """Validation and test batches, forever (module docstring)."""
    return LoaderBatches(dataset, consumed_samples, settings, name, cycle=True)


def training_iterator(dataset, consumed_samples: int, settings: LoaderSettings) -> LoaderBatches:
    """Training batches: one ordered pass (single) or every epoch reshuffled (cyclic)."""
    return LoaderBatches(dataset, consumed_samples, settings, "training", cycle=settings.dataloader_type == "cyclic")


@dataclass
class DataIterators:
    """Iterators of this rank; None where this rank reads no data (middle pipeline stages)."""

    train: LoaderBatches | None = None
    valid: list[tuple[str, LoaderBatches | None]] = field(default_factory=list)
    test: list[tuple[str, LoaderBatches | None]] = field(default_factory=list)

    def close(self) -> None:
        """Shut every loader's workers down (LoaderBatches.close) before the interpreter exits."""
        for iterator in [self.train] + [it for _, it in self.valid] + [it for _, it in self.test]:
            if iterator is not None:
                iterator.close()


def check_dataset_files(dataset: GPTDatasetConfig) -> None:
    """Open every dataset the run reads, once each, before any process group or model exists: a
    missing or damaged one, or one whose dtype or sampled token ids do not fit the tokenizer's
    vocabulary, raises ArgumentError naming the flag and the file, with a hint at the likely prefix
    (megatron.core.data.indexed_dataset.check_dataset_prefix)."""
    checked = set()
    for flag, prefix in dataset.prefixes():
        if prefix in checked:
            continue
        checked.add(prefix)
        try:
            check_dataset_prefix(prefix, dataset.data_impl, dataset.vocab_size)
        except IndexedDatasetError as exc:
            raise ArgumentError(f"{flag}: {exc}") from None


def build_datasets(data_config: DataConfig, num_samples: tuple[int, int, int]) -> TrainValidTestDatasets:
    """The train/valid/test datasets; collective over the world (index caches built by rank 0)."""
    if data_config.dataset is None:
        raise DataLoadingError("no training data: give --data-path or --train-weighted-split-paths")
    return build_train_valid_test_datasets(data_config.dataset, num_samples)


def build_iterators(datasets: TrainValidTestDatasets, reads_data: bool, train_settings: LoaderSettings,
                    valid_settings: LoaderSettings, consumed_train_samples: int,
                    consumed_valid_samples: int) -> DataIterators:
    """This rank's iterators (all None when ``reads_data`` is False); valid/test keep their set names."""
    if not reads_data:
        return DataIterators(train=None, valid=[(name, None) for name, _ in datasets.valid],
                             test=[(name, None) for name, _ in datasets.test])
    train = None
    if datasets.train is not None:
        train = training_iterator(datasets.train, consumed_train_samples, train_settings)
    valid = [(name, cycling_iterator(dataset, consumed_valid_samples, valid_settings, name))
             for name, dataset in datasets.valid]
    test = [(name, cycling_iterator(dataset, 0, valid_settings, name)) for name, dataset in datasets.test]
    return DataIterators(train=train, valid=valid, test=test)
