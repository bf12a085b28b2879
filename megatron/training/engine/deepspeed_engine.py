"""DeepSpeed's engine behind the TrainingEngine protocol (interface.py).

``start_engine`` runs ``deepspeed.initialize`` on our model, optimizer, LR schedule and groups, checks
DeepSpeed's rank grid and precision against ours, applies the declared replacements
(replacements.py) and returns one of two adapters:

    PipelineEngine     DeepSpeed's PipelineEngine on GPTModelPipe: ``train_batch`` / ``eval_batch``
                       run the 1F1B schedule over the micro batches; only the first and last stage
                       read data
    PlainEngine        DeepSpeed's engine on GPTModel (ZeRO 2 and 3): forward, backward and step per
                       micro batch, the optimizer stepping at the last
"""
import contextlib
import importlib
import sys
import types

import deepspeed
import torch
from deepspeed.pipe import PipelineModule

from megatron.core.checkpoint.megatron_deepspeed import has_optimizer_partitions
from megatron.core.checkpoint.universal_writer import OPTIMIZER_PARAMETER_NAMES
from megatron.core.parallel_state import ParallelGroups
from megatron.training import dist_utils
from megatron.training.config import TrainConfig
from megatron.training.data_loading import pipeline_batch
from megatron.training.engine import bf16_steps, checkpoint_io, zero3
from megatron.training.engine.fp32_steps import (count_zeros_before_each_step, guard_fp32_steps,
                                                 synchronize_after_each_step)
from megatron.training.engine.interface import BatchFunction, ReadFilter
from megatron.training.engine.megatron_deepspeed_resume import restore_optimizer_states, translating_filter
from megatron.training.engine.mpu import DeepSpeedMPU
from megatron.training.engine.replacements import is_enabled
from megatron.training.lr_schedule import AnnealingLR


class EngineSetupError(RuntimeError):
    """The DeepSpeed engine does not match the configuration (rank grid, precision)."""


def check_engine_grid(engine, groups: ParallelGroups) -> None:
    """Raise EngineSetupError unless DeepSpeed's view of the rank grid is ours, rank list by rank list.

    ``engine.grid`` is the pipeline engine's PipelineParallelGrid; the plain engine uses our mpu.
    """
    grid = getattr(engine, "grid", None)
    if grid is None:
        found = {"dp size": engine.dp_world_size}
        expected = {"dp size": groups.dp_size}
    else:
        found = {"stage": grid.get_stage_id(), "data-parallel rank": grid.get_data_parallel_id(),
                 "tensor rank": grid.get_slice_parallel_rank(), "data-parallel group": sorted(grid.dp_group),
                 "pipeline group": sorted(grid.pp_group), "tensor group": sorted(grid.slice_group)}
        expected = {"stage": groups.pp_rank, "data-parallel rank": groups.dp_rank, "tensor rank": groups.tp_rank,
                    "data-parallel group": sorted(groups.dp_ranks), "pipeline group": sorted(groups.pp_ranks),
                    "tensor group": sorted(groups.tp_ranks)}
    wrong = [f"{key}: DeepSpeed {found[key]}, ours {expected[key]}" for key in found if found[key] != expected[key]]
    if wrong:
        raise EngineSetupError(f"rank {groups.global_rank}: DeepSpeed's rank grid differs from the model-parallel "
                               f"groups ({'; '.join(wrong)})")


def check_engine_precision(engine, config: TrainConfig) -> None:
    """The engine must run the precision the flags and the ds_config agreed on (Megatron-DeepSpeed asserts it too)."""
    if engine.fp16_enabled() != config.precision.fp16 or engine.bfloat16_enabled() != config.precision.bf16:
        raise EngineSetupError(f"DeepSpeed runs fp16={engine.fp16_enabled()} bf16={engine.bfloat16_enabled()} but "
                               f"the configuration says fp16={config.precision.fp16} bf16={config.precision.bf16}")


ZERO3_STEPS_LINE = ("ZeRO-3: the bf16 step replacements (one-kernel gradient accumulation, weight-gradient "
                    "fusion of --gradient-accumulation-fusion, few-kernel norm, Triton AdamW writing the bf16 "
                    "weights, clip inside AdamW) are off: they work on BF16_Optimizer's flat fp32 buffers, which "
                    "ZeRO-3 replaces by its own partitions; DeepSpeed's stage-3 optimizer steps the torch AdamW "
                    "(fused on CUDA) on them")
SHARED_GRADIENTS_LINE = ("ZeRO-3 offload: the CPU optimizer's fp32 gradients are views of the buffer the reduced "
                         "gradients accumulate in")


def apply_replacements(engine, config: TrainConfig, groups: ParallelGroups) -> None:
    """The declared replacements this engine's configuration calls for (replacements.py)."""
    pipeline = isinstance(engine.module, PipelineModule)
    if not (engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization()):
        guard_fp32_steps(engine, groups)
    freed = zero3.share_offloaded_gradient_partitions(engine)
    if freed:
        dist_utils.print_rank_0(f"{SHARED_GRADIENTS_LINE} ({freed / 2 ** 30:.2f} GiB less host memory on rank 0)")
    if engine.bfloat16_enabled() and engine.zero_optimization_stage() == 3:
        dist_utils.print_rank_0(ZERO3_STEPS_LINE)
    elif engine.bfloat16_enabled():
        bf16_steps.accumulate_in_one_kernel(engine)
        if config.precision.gradient_accumulation_fusion:
            bf16_steps.fuse_weight_gradient_accumulation(engine)
        bf16_steps.norm_in_few_kernels(engine)
        bf16_steps.adamw_writes_bf16_weights(engine)  # before the clip, which wraps the step it leaves
        bf16_steps.clip_in_adamw(engine)
        bf16_steps.skip_single_rank_reduction(engine)
    if pipeline and (getattr(engine, "using_bf16_optimizer", False) or not engine.zero_optimization()):
        engine.module.defer_sequence_parallel_reduction()
    if config.logging.log_num_zeros_in_grad:
        count_zeros_before_each_step(engine, groups)
    if config.parallel.sync_tp_duplicated_parameters and groups.tp_size > 1:
        synchronize_after_each_step(engine, groups)


def start_engine(config: TrainConfig, groups: ParallelGroups, model: torch.nn.Module,
                 torch_optimizer: torch.optim.Optimizer, lr_scheduler: AnnealingLR,
                 make_batch: BatchFunction) -> "DeepSpeedAdapter":
    """deepspeed.initialize on our model, optimizer, schedule and groups, checked against our grid;
    ``make_batch`` turns a loader item into the trainer's batch."""
    pipeline = isinstance(model, PipelineModule)
    without_muon()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch_optimizer, lr_scheduler=lr_scheduler,
                                           mpu=None if pipeline else DeepSpeedMPU(groups),
                                           config=engine_ds_config(config))
    check_engine_grid(engine, groups)
    check_engine_precision(engine, config)
    apply_replacements(engine, config, groups)
    adapter = PipelineEngine if pipeline else PlainEngine
    return adapter(engine, config, groups, make_batch)


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def without_muon() -> None:
    """DeepSpeed imports its Muon optimizer's module only to compare an optimizer's type with
    MuonWithAuxAdam, in ZeRO's optimizer check and in every ZeRO-1/2 gradient reduction; the module
    compiles kernels and imports torch's inductor, ~2 s of every process's start. The trainer never
    builds Muon (the flags and a ds_config optimizer block are refused), so a module holding only an
    empty class of that name gives DeepSpeed the same answers (not Muon) without the import."""
    if not is_enabled("deepspeed_engine.without_muon") or MUON_MODULE in sys.modules:
        return
    stand_in = types.ModuleType(MUON_MODULE, "Stands in for DeepSpeed's Muon optimizer (the trainer never builds it).")
    stand_in.MuonWithAuxAdam = type("MuonWithAuxAdam", (), {})
    sys.modules[MUON_MODULE] = stand_in
    importlib.import_module("deepspeed.runtime.zero.muon").muon_optimizer = stand_in


def engine_ds_config(config: TrainConfig) -> dict:
    """The ds_config ``deepspeed.initialize`` gets. Under DeepSpeed-Ulysses DeepSpeed's data-parallel
    world is the S x D ranks averaging gradients, which count each sample once per sequence-parallel
    rank: its train_batch_size is S x the global batch (the micro batches per step are the same)."""
    ds_config = config.deepspeed.config_for_initialize()
    ds_config["train_batch_size"] *= config.parallel.sequence_parallel_size
    return ds_config


class DeepSpeedAdapter:
    """What both adapters share: counters, norms, checkpoints (interface.TrainingEngine)."""

    pipeline_layout = True

    def __init__(self, engine, config: TrainConfig, groups: ParallelGroups, make_batch: BatchFunction):
        self.engine, self.module = engine, engine.module
        self.config, self.groups, self.make_batch = config, groups, make_batch

    def set_global_batch(self, samples: int) -> None:
        self.engine.set_train_batch_size(samples * self.groups.sp_size)  # engine_ds_config

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    def grad_norm(self) -> float | None:
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def loss_scale(self) -> float | None:
        optimizer = self.engine.optimizer
        scaler = getattr(optimizer, "loss_scale_config", None)
        scale = scaler.cur_scale if scaler is not None else getattr(optimizer, "cur_scale", None)
        return None if scale is None else float(scale)

    def last_step_extras(self) -> tuple[int | None, tuple[float, str | None]]:
        return (getattr(self.engine, "num_zeros_in_grad", None), getattr(self.engine, "tp_drift", (0.0, None)))

    def save(self, directory: str, tag: str, client_state: dict, file_written) -> None:
        if self.config.parallel.zero_stage == 0:
            client_state = {**client_state,
                            OPTIMIZER_PARAMETER_NAMES: checkpoint_io.optimizer_parameter_names(self.engine)}
        whole_module = (checkpoint_io.zero3_model_states(self.engine, self.groups.dp_rank)
                        if self.config.parallel.zero_stage == 3 else contextlib.nullcontext())
        with checkpoint_io.recorded_writes(self.engine, file_written), whole_module:
            self.engine.save_checkpoint(directory, tag=tag, client_state=client_state, save_latest=False)
        if self.pipeline_layout and dist_utils.is_rank_0():
            checkpoint_io.remove_recovery_scripts(directory)

    def load(self, directory: str, tag_directory: str, *, load_optimizer: bool, load_lr_scheduler: bool,
             read_filters: list[ReadFilter], universal: bool, megatron_deepspeed: bool) -> dict:
        # Megatron-DeepSpeed's ZeRO partitions flatten other parameter groups than ours: their states move by name
        by_name = megatron_deepspeed and has_optimizer_partitions(tag_directory)
        if megatron_deepspeed:
            read_filters = [*read_filters, translating_filter(load_optimizer)]
        renaming = universal and not self.pipeline_layout
        zero3 = self.config.parallel.zero_stage == 3
        whole_module = (checkpoint_io.zero3_module_reads(self.engine, load_optimizer) if zero3
                        else contextlib.nullcontext())
        zero3_universal = (checkpoint_io.zero3_universal_reads(self.engine, self.groups.tp_rank, self.groups.tp_size,
                                                               tag_directory)
                           if zero3 and universal else contextlib.nullcontext())
        with checkpoint_io.filtered_reads(self.engine, read_filters), whole_module, zero3_universal, \
                checkpoint_io.universal_parameter_names(self.engine, self.config.model.num_layers, renaming):
            _, state = self.engine.load_checkpoint(directory, load_optimizer_states=load_optimizer and not by_name,
                                                   load_lr_scheduler_states=load_lr_scheduler,
                                                   custom_load_fn=checkpoint_io.load_zero3_module if zero3 else None)
        if by_name and load_optimizer:
            restore_optimizer_states(self.engine, tag_directory)
        if universal:
            checkpoint_io.steps_beside_moments(self.engine)
        return state

    def restart_counters(self) -> None:
        self.engine.global_steps = 0
        self.engine.global_samples = 0
        self.engine.skipped_steps = 0


class PipelineEngine(DeepSpeedAdapter):
    """GPTModelPipe on DeepSpeed's PipelineEngine (module docstring)."""

    def __init__(self, engine, config: TrainConfig, groups: ParallelGroups, make_batch: BatchFunction):
        super().__init__(engine, config, groups, make_batch)
        self.reads_data = groups.is_first_stage or groups.is_last_stage
        engine.set_batch_fn(lambda data: pipeline_batch(make_batch(data)))
        if config.data.reset_attention_mask:
            engine.set_has_attention_mask(True)

    def train_step(self, data_iterator, num_micro_batches: int) -> float:
        return float(self.engine.train_batch(data_iter=data_iterator))

    def eval_step(self, data_iterator, num_micro_batches: int) -> float:
        return float(self.engine.eval_batch(data_iter=data_iterator))

    def sequence_length_changed(self) -> None:
        self.engine.reset_activation_shape()


class PlainEngine(DeepSpeedAdapter):
    """GPTModel on DeepSpeed's engine (module docstring)."""

    pipeline_layout = False
    reads_data = True

    def _loss(self, data: dict) -> torch.Tensor:
        batch = self.make_batch(data)
        return self.engine(batch.tokens, batch.position_ids, batch.attention_mask, batch.labels, batch.loss_mask)

    def _mean_over_data_parallel(self, losses: list[torch.Tensor]) -> float:
        local_mean = float(torch.stack(losses).mean())
        return dist_utils.average_across_group([local_mean], self.groups.process_groups["dp"])[0]

    def train_step(self, data_iterator, num_micro_batches: int) -> float:
        losses = []
        for index in range(num_micro_batches):
            self.engine.set_gradient_accumulation_boundary(index == num_micro_batches - 1)
            loss = self._loss(next(data_iterator))
            self.engine.backward(loss)
            self.engine.step()
            losses.append(loss.detach())
        return self._mean_over_data_parallel(losses)

    def eval_step(self, data_iterator, num_micro_batches: int) -> float:
        self.engine.eval()
        with torch.no_grad():
            losses = [self._loss(next(data_iterator)) for _ in range(num_micro_batches)]
        self.engine.train()
        return self._mean_over_data_parallel(losses)

    def sequence_length_changed(self) -> None:
        """The plain engine takes each batch as it comes."""
