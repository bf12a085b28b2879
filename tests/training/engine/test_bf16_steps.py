"""megatron/training/engine/bf16_steps.py: the fused fp32 accumulation of bf16 gradients on DeepSpeed's
BF16_Optimizer, the weight-gradient GEMMs adding into its fp32 accumulators (gradient-accumulation
fusion), the gradient norm over the flat accumulators, the AdamW step writing the bf16 weights, the clip folded into the fused AdamW step, and the
pipeline engine's one-rank gradient "reduction" skipped."""
import functools

import torch

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.training.engine import bf16_steps
from megatron.training.engine.bf16_steps import (accumulate_in_one_kernel,
                                                    fuse_weight_gradient_accumulation,
                                                    clip_in_adamw,
                                                    skip_single_rank_reduction,
                                                    norm_in_few_kernels,
                                                    adamw_writes_bf16_weights)
from tests.dist_utils import run_distributed


def _deepspeed_on_the_cpu():
    """DeepSpeed with its CPU accelerator also where CUDA exists (it picks one when first imported,
    which in a test worker has happened already): the comparisons below are bit for bit, which
    holds for the CPU's arithmetic (on CUDA the fused GEMM sums dW unrounded)."""
    import deepspeed
    from deepspeed.accelerator import set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    set_accelerator(CPU_Accelerator())
    return deepspeed


def _bf16_engine(fused: bool):
    deepspeed = _deepspeed_on_the_cpu()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 8))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3, "bf16": {"enabled": True},
              "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert engine.device.type == "cpu"  # _deepspeed_on_the_cpu
    if fused:
        before = engine.optimizer._update_hp_grad
        accumulate_in_one_kernel(engine)
        assert engine.optimizer._update_hp_grad is not before
    return engine


def _accumulated_gradients(engine) -> list[torch.Tensor]:
    """The fp32 accumulators after 3 micro-batches (bf16 gradients of different scales)."""
    generator = torch.Generator().manual_seed(1)
    for micro_batch in range(3):
        x = torch.randn(4, 24, generator=generator, dtype=torch.bfloat16) * 10.0 ** micro_batch
        engine.backward(engine(x).float().square().mean())
    return [grad.clone() for group in engine.optimizer.fp32_groups_gradients for grad in group]


def _fused_equals_deepspeeds(rank, world_size):
    reference = _accumulated_gradients(_bf16_engine(fused=False))
    fused = _accumulated_gradients(_bf16_engine(fused=True))
    assert len(fused) == len(reference) == 4 and all(grad.dtype == torch.float32 for grad in fused)
    assert any(grad.abs().sum() > 0 for grad in fused)
    for ours, theirs in zip(fused, reference):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_fused_accumulation_equals_deepspeeds_bit_for_bit():
    run_distributed(_fused_equals_deepspeeds, 1)


class _ParallelMLP(torch.nn.Module):
    """h -> 4h -> h through a column- and a row-parallel layer at TP 1, biases added by the layers."""

    def __init__(self):
        super().__init__()
        init = functools.partial(torch.nn.init.normal_, std=0.2)
        torch.manual_seed(0)
        self.column = ColumnParallelLinear(24, 40, tp_group=None, init_method=init, use_cpu_initialization=True)
        self.row = RowParallelLinear(40, 24, tp_group=None, init_method=init, use_cpu_initialization=True)

    def forward(self, x):
        return self.row(torch.nn.functional.gelu(self.column(x)[0]))[0]


def _mlp_engine(fused: bool, fused_adamw: bool = False):
    deepspeed = _deepspeed_on_the_cpu()

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3, "bf16": {"enabled": True},
              "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 1},
              "gradient_clipping": 0.5}
    model = _ParallelMLP().to(torch.bfloat16)
    if fused_adamw:  # the trainer's optimizer on CUDA (build_optimizer); torch has a fused CPU kernel too
        optimizer = {"optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)}
    else:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}
        optimizer = {"model_parameters": model.parameters()}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, **optimizer)
    assert engine.device.type == "cpu"  # _deepspeed_on_the_cpu
    accumulate_in_one_kernel(engine)
    if fused:
        assert fuse_weight_gradient_accumulation(engine) == 2  # the two layers' weights
    return engine


def _two_steps(engine) -> tuple[list[float], list[torch.Tensor]]:
    """Grad norms of two optimizer steps of 3 micro-batches each, and the bf16 parameters after them."""
    generator = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(2):
        for _ in range(3):
            x = torch.randn(4, 5, 24, generator=generator, dtype=torch.bfloat16)
            loss = engine(x).float().square().mean()
            engine.backward(loss)
            engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    return norms, [param.detach().clone() for param in engine.module.parameters()]


def _fused_steps_equal_autograds(rank, world_size):
    reference_norms, reference_params = _two_steps(_mlp_engine(fused=False))
    engine = _mlp_engine(fused=True)
    weights = [engine.module.column.weight, engine.module.row.weight]
    assert all(weight.main_grad.dtype == torch.float32 for weight in weights)
    norms, params = _two_steps(engine)
    assert all(weight.grad is None for weight in weights)  # dW went straight into the accumulators
    assert norms == reference_norms and norms[0] > 0.5  # clipped: the norm counts the fused weights
    for ours, theirs in zip(params, reference_params):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_weight_gradient_gemms_accumulating_into_fp32_give_deepspeeds_steps():
    """Over two data-parallel ranks: ZeRO-1 reduces the accumulators and steps each rank's partition."""
    run_distributed(_fused_steps_equal_autograds, 2)


def _master_weights(engine) -> torch.Tensor:
    return torch.cat([flat.detach().clone() for flat in engine.optimizer.fp32_groups_flat_partition])


def _clip_in_adamw_equals_deepspeeds_clip(rank, world_size):
    reference_engine = _mlp_engine(fused=True, fused_adamw=True)
    reference_norms, _ = _two_steps(reference_engine)
    engine = _mlp_engine(fused=True, fused_adamw=True)
    assert clip_in_adamw(engine)
    norms, _ = _two_steps(engine)
    assert norms == reference_norms and norms[0] > 0.5  # the first step clipped
    assert engine.optimizer.clip_grad == 0.5 and engine.optimizer.state_dict()["clip_grad"] == 0.5
    assert not hasattr(engine.optimizer.optimizer, "grad_scale")
    # g / ((||g|| + eps) / clip) against g * (clip / (||g|| + eps)): fp32 roundings apart
    torch.testing.assert_close(_master_weights(engine), _master_weights(reference_engine), rtol=1e-6, atol=1e-7)
    unclipped = _mlp_engine(fused=True, fused_adamw=True)
    unclipped.optimizer.clip_grad = 0.0
    _two_steps(unclipped)
    assert not torch.allclose(_master_weights(unclipped), _master_weights(engine), rtol=1e-4, atol=0)


def test_clip_folded_into_the_fused_adamw_step_gives_deepspeeds_clipped_steps():
    """Over two data-parallel ranks, as above; the unclipped steps differ, so the clip took effect."""
    run_distributed(_clip_in_adamw_equals_deepspeeds_clip, 2)


def test_clip_stays_with_deepspeed_without_a_fused_adamw():
    run_distributed(_clip_stays_with_deepspeed, 1)


def _clip_stays_with_deepspeed(rank, world_size):
    engine = _mlp_engine(fused=False)  # DeepSpeed's torch_adam: AdamW without fused=True
    assert not clip_in_adamw(engine)


def _tied_engine(patched: bool):
    """An MLP engine whose row bias is marked as the pipeline's second copy of a tied parameter, which
    the norm leaves out."""
    engine = _mlp_engine(fused=True, fused_adamw=True)
    engine.module.row.bias.ds_pipe_replicated = True
    if patched:
        assert norm_in_few_kernels(engine)
    return engine


def _norms_in_few_kernels_equal_deepspeeds(rank, world_size):
    reference_norms, reference_params = _two_steps(_mlp_engine(fused=True, fused_adamw=True))
    engine = _mlp_engine(fused=True, fused_adamw=True)
    assert norm_in_few_kernels(engine)
    grads, experts = engine.optimizer.get_grads_for_norm()
    assert len(grads) == len(engine.optimizer.bf16_groups) and experts == {}  # the flat accumulators
    norms, params = _two_steps(engine)
    assert norms[0] > 0.5  # clipped: the norm reached the clip
    torch.testing.assert_close(norms, reference_norms, rtol=1e-6, atol=0)  # fp32 sums in another order
    for ours, theirs in zip(params, reference_params):
        torch.testing.assert_close(ours, theirs, rtol=1e-2, atol=1e-3)  # a bf16 rounding apart at most
    tied_norms, _ = _two_steps(_tied_engine(patched=True))  # the multi-tensor norm of DeepSpeed's list
    torch.testing.assert_close(tied_norms, _two_steps(_tied_engine(patched=False))[0], rtol=1e-6, atol=0)
    assert abs(tied_norms[0] - norms[0]) > 1e-3 * norms[0]  # the tied copy was left out


def test_gradient_norm_in_few_kernels_is_deepspeeds():
    """Over two data-parallel ranks: the norms (so the clip) of two steps, over the flat accumulators,
    and with a tied copy left out over the multi-tensor norms of DeepSpeed's list."""
    run_distributed(_norms_in_few_kernels_equal_deepspeeds, 2)


def _bf16_partitions_equal_the_master_weights(engine):
    """Every rank's bf16 partition of every group is its fp32 master partition rounded to bf16 (the
    rank's own written by the step, the others' all-gathered)."""
    optimizer = engine.optimizer
    for fp32_partition, bf16_partitions in zip(optimizer.fp32_groups_flat_partition,
                                               optimizer.bf16_partitioned_groups):
        gathered = [torch.empty_like(fp32_partition) for _ in bf16_partitions]
        torch.distributed.all_gather(gathered, fp32_partition.detach())
        for master, bf16 in zip(gathered, bf16_partitions):
            assert torch.equal(bf16, master.bfloat16())


def _adamw_writing_bf16_equals_deepspeeds_step(rank, world_size):
    reference_engine = _mlp_engine(fused=True, fused_adamw=True)
    clip_in_adamw(reference_engine)
    reference_norms, _ = _two_steps(reference_engine)
    bf16_steps.runs_fused_adamw = lambda tensor: True  # the reference kernel on the CPU
    engine = _mlp_engine(fused=True, fused_adamw=True)
    copy_and_gather = engine.optimizer.update_lp_params
    assert adamw_writes_bf16_weights(engine) and clip_in_adamw(engine)
    norms, _ = _two_steps(engine)
    assert norms[0] == reference_norms[0] > 0.5  # clipped, so the grad_scale reached the step
    assert abs(norms[1] - reference_norms[1]) <= 1e-6 * reference_norms[1]
    torch.testing.assert_close(_master_weights(engine), _master_weights(reference_engine), rtol=1e-6, atol=1e-7)
    _bf16_partitions_equal_the_master_weights(engine)
    ours, theirs = engine.optimizer.optimizer.state_dict(), reference_engine.optimizer.optimizer.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    for state, reference_state in zip(ours["state"].values(), theirs["state"].values(), strict=True):
        assert state.keys() == reference_state.keys() and float(state["step"]) == float(reference_state["step"]) == 2
        assert all(state[key].dtype == reference_state[key].dtype for key in state)
    # fp32 weights changed outside a step (a loaded checkpoint): DeepSpeed's copy runs
    assert engine.optimizer.update_lp_params is not copy_and_gather
    for master in engine.optimizer.fp32_groups_flat_partition:
        master.data.mul_(0.5)
    engine.optimizer.update_lp_params()
    _bf16_partitions_equal_the_master_weights(engine)


def test_adamw_step_writing_the_bf16_weights_gives_deepspeeds_steps():
    """Over two data-parallel ranks with the clip folded in, the fused step (its reference on the
    CPU) against torch's fused AdamW and DeepSpeed's copy: the same norms and master weights within
    fp32 roundings, every bf16 partition the master's rounding, torch's optimizer state format."""
    run_distributed(_adamw_writing_bf16_equals_deepspeeds_step, 2)


def test_adamw_step_stays_with_torch_where_its_kernel_does_not_run():
    run_distributed(_adamw_stays_with_torch, 1)


def _adamw_stays_with_torch(rank, world_size):
    assert not adamw_writes_bf16_weights(_mlp_engine(fused=True, fused_adamw=True))  # CPU
    bf16_steps.runs_fused_adamw = lambda tensor: True
    assert not adamw_writes_bf16_weights(_mlp_engine(fused=False))  # not a fused AdamW


def _pipeline_engine(communication_dtype: str | None = None):
    """A one-stage DeepSpeed pipeline engine (the trainer's engine at PP = 1) on BF16_Optimizer."""
    deepspeed = _deepspeed_on_the_cpu()
    from deepspeed.pipe import PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")  # the module's topology needs it before initialize
    torch.manual_seed(0)
    model = PipelineModule(layers=[torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 24)], num_stages=1,
                           loss_fn=lambda out, label: (out.float() - label.float()).square().mean())
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3, "bf16": {"enabled": True},
              "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 1},
              "gradient_clipping": 0.5, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
    if communication_dtype is not None:
        config["communication_data_type"] = communication_dtype
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _pipeline_weights(engine) -> torch.Tensor:
    """The fp32 master weights after two steps of 3 micro-batches."""
    generator = torch.Generator().manual_seed(1)
    batches = iter([(torch.randn(4, 24, generator=generator).bfloat16(), torch.randn(4, 24, generator=generator))
                    for _ in range(6)])
    for _ in range(2):
        engine.train_batch(batches)
    return _master_weights(engine)


def _one_rank_skips_the_rounding(rank, world_size):
    engine = _pipeline_engine()
    assert skip_single_rank_reduction(engine)
    weights = _pipeline_weights(engine)
    # the same as DeepSpeed's with an fp32 "reduction" (the identity), not as its default bf16 one
    assert torch.equal(weights, _pipeline_weights(_pipeline_engine(communication_dtype="fp32")))
    assert not torch.equal(weights, _pipeline_weights(_pipeline_engine()))


def _two_ranks_keep_the_reduction(rank, world_size):
    assert not skip_single_rank_reduction(_pipeline_engine())


def test_one_data_parallel_rank_leaves_the_bf16_accumulators_unrounded():
    run_distributed(_one_rank_skips_the_rounding, 1)


def test_two_data_parallel_ranks_keep_deepspeeds_reduction():
    run_distributed(_two_ranks_keep_the_reduction, 2)
