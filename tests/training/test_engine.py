"""megatron/training/engine.py: the fused fp32 accumulation of bf16 gradients on DeepSpeed's BF16_Optimizer."""
import torch

from megatron.training.engine import accumulate_bf16_gradients_in_one_kernel
from tests.dist_utils import run_distributed


def _bf16_engine(fused: bool):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 8))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3, "bf16": {"enabled": True},
              "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if fused:
        before = engine.optimizer._update_hp_grad
        accumulate_bf16_gradients_in_one_kernel(engine)
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
