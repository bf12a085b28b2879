"""RNG tracker and activation checkpointing (megatron/core/tensor_parallel/random.py), and DeepSpeed's
checkpointing replaying the tracker once the engine shares it (megatron/training/engine/activation_checkpointing.py)."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.parallel_state import initialize_model_parallel
from megatron.core.tensor_parallel.random import (
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    checkpoint,
    get_rng_tracker,
    model_parallel_seed,
)
from megatron.training.engine.activation_checkpointing import share_rng_tracker
from megatron.training.engine.mpu import DeepSpeedMPU
from tests.dist_utils import run_distributed

SEED = 1234


def test_fork_draws_from_its_own_stream_and_leaves_the_default_one():
    tracker = RNGStatesTracker()
    tracker.add("stream", 5)
    torch.manual_seed(0)
    with tracker.fork("stream"):
        first = torch.rand(4)
    outside = torch.rand(4)
    with tracker.fork("stream"):
        second = torch.rand(4)
    generator = torch.Generator().manual_seed(5)
    assert torch.equal(first, torch.rand(4, generator=generator))
    assert torch.equal(second, torch.rand(4, generator=generator))  # the stream continues where it stopped
    torch.manual_seed(0)
    assert torch.equal(outside, torch.rand(4))  # the default stream never saw the fork


def test_fork_restores_default_stream_on_error():
    tracker = RNGStatesTracker()
    tracker.add("stream", 5)
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="inside"):
        with tracker.fork("stream"):
            torch.rand(3)
            raise RuntimeError("inside")
    after = torch.rand(2)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(2))


def test_tracker_rejects_duplicates_and_unknown_streams():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="model_parallel_seed"):
        with tracker.fork("missing"):
            pass
    tracker.reset()
    tracker.add("a", 1)


def test_get_and_set_states_rewind_a_stream():
    tracker = RNGStatesTracker()
    tracker.add(MODEL_PARALLEL_RNG, 9)
    saved = tracker.get_states()
    with tracker.fork():
        first = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(torch.rand(3), first)


def test_model_parallel_seed_values():
    model_parallel_seed(SEED, tp_rank=3, pp_rank=2)
    default_draw = torch.rand(5)
    with get_rng_tracker().fork():
        tracker_draw = torch.rand(5)
    assert torch.equal(default_draw, torch.rand(5, generator=torch.Generator().manual_seed(SEED + 200)))
    expected = torch.rand(5, generator=torch.Generator().manual_seed(SEED + 200 + 2718 + 3))
    assert torch.equal(tracker_draw, expected)


class _Block(torch.nn.Module):
    """Linear -> dropout on the default stream -> linear -> dropout on the model-parallel stream."""

    def __init__(self, hidden=16):
        super().__init__()
        self.first, self.second = torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, hidden)

    def forward(self, x, scale, mask):
        h = F.dropout(torch.tanh(self.first(x)), p=0.3) * scale
        with get_rng_tracker().fork():
            h = F.dropout(self.second(h), p=0.5)
        return h.masked_fill(mask, 0.0), h.sum()


def _loss_and_grads(block, x, use_checkpoint, distribute=False, tp_group=None):
    """Forward/backward twice in a row (so the RNG streams must also advance identically)."""
    block.zero_grad()
    x = x.clone().requires_grad_(True)
    mask = torch.zeros(x.shape, dtype=torch.bool)
    mask[0] = True
    outputs = []
    for _ in range(2):
        if use_checkpoint:
            y, total = checkpoint(block, distribute, x, 0.5, mask, tp_group=tp_group)
        else:
            y, total = block(x, 0.5, mask)
        (y.square().sum() + total).backward()
        outputs.append(y.detach())
    return outputs, x.grad, [p.grad.clone() for p in block.parameters()], torch.rand(3)


def _assert_checkpoint_bit_exact(block, x, seeds, distribute=False, tp_group=None):
    results = []
    for use_checkpoint in (False, True):
        model_parallel_seed(SEED, *seeds)
        results.append(_loss_and_grads(block, x, use_checkpoint, distribute, tp_group))
    (outs, gx, grads, after), (outs_ckpt, gx_ckpt, grads_ckpt, after_ckpt) = results
    assert all(torch.equal(a, b) for a, b in zip(outs, outs_ckpt))
    assert not torch.equal(outs[0], outs[1])  # dropout is really on
    assert torch.equal(gx, gx_ckpt)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ckpt))
    assert torch.equal(after, after_ckpt)


def test_checkpoint_is_bit_exact_with_dropout():
    torch.manual_seed(0)
    _assert_checkpoint_bit_exact(_Block(), torch.randn(4, 2, 16), seeds=(0, 0))


def test_checkpoint_needs_an_input_that_requires_grad():
    block, x = _Block(), torch.randn(2, 16)
    mask = torch.zeros(x.shape, dtype=torch.bool)
    model_parallel_seed(SEED, 0, 0)
    with pytest.raises(ValueError, match="requires grad"):
        checkpoint(block, False, x, 1.0, mask)
    with torch.no_grad():
        y, _ = checkpoint(block, False, x, 1.0, mask)
    assert y.shape == x.shape


def _dropout_masks(groups):
    """All-gather over TP of a dropout mask drawn inside and outside the fork."""
    ones = torch.ones(64)
    outside = F.dropout(ones, p=0.5)
    with get_rng_tracker().fork():
        inside = F.dropout(ones, p=0.5)
    gathered = []
    for mask in (outside, inside):
        parts = [torch.empty_like(mask) for _ in range(groups.tp_size)]
        dist.all_gather(parts, mask, group=groups.tp)
        gathered.append(parts)
    return gathered


def _check_partitioned_checkpoint(groups):
    """distribute_saved_activations keeps 1/k of each floating-point input and gathers it in backward."""
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(5, 3, 16)  # 240 elements; the same on both TP ranks
    seeds = (groups.tp_rank, groups.pp_rank)
    _assert_checkpoint_bit_exact(block, x, seeds, distribute=True, tp_group=groups.tp)
    saved_sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved_sizes.append(t.numel()) or t, lambda t: t):
        mask = torch.zeros(x.shape, dtype=torch.bool)
        checkpoint(block, True, x.clone().requires_grad_(True), 0.5, mask, tp_group=groups.tp)
    assert saved_sizes == [x.numel() // groups.tp_size, mask.numel()]  # the input's share, the bool mask
    # 105 elements: the chunks are zero-padded to 53 per rank and trimmed again in backward.
    _assert_checkpoint_bit_exact(_Block(hidden=15), torch.randn(7, 1, 15), seeds, distribute=True,
                                 tp_group=groups.tp)


def _check_deepspeed_checkpointing(groups):
    """DeepSpeed's own checkpoint (partitioned) replays our tracker once it is shared with DeepSpeed."""
    import deepspeed

    deepspeed.checkpointing.configure(DeepSpeedMPU(groups), partition_activations=True)
    share_rng_tracker()
    torch.manual_seed(0)
    block, x = _Block(), torch.randn(4, 2, 16)
    mask = torch.zeros(x.shape, dtype=torch.bool)
    results = []
    for use_checkpoint in (False, True):
        model_parallel_seed(SEED, groups.tp_rank, groups.pp_rank)
        block.zero_grad()
        x_in = x.clone().requires_grad_(True)
        run = deepspeed.checkpointing.checkpoint if use_checkpoint else (lambda f, *a: f(*a))
        # With partitioned activations DeepSpeed mis-merges non-tensor arguments: pass tensors only.
        y, total = run(lambda inputs, masked: block(inputs, 0.5, masked), x_in, mask)
        (y.square().sum() + total).backward()
        results.append((y.detach(), x_in.grad, [p.grad.clone() for p in block.parameters()]))
    (y, gx, grads), (y_ckpt, gx_ckpt, grads_ckpt) = results
    assert torch.equal(y, y_ckpt) and torch.equal(gx, gx_ckpt)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ckpt))


def _random_world4(rank, world_size):
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    groups = initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    model_parallel_seed(SEED, groups.tp_rank, groups.pp_rank)
    (outside, inside) = _dropout_masks(groups)
    assert torch.equal(outside[0], outside[1])  # replicated tensors: same mask on both TP ranks
    assert not torch.equal(inside[0], inside[1])  # split tensors: independent masks
    stages = [torch.empty(64) for _ in range(world_size)]
    dist.all_gather(stages, outside[0])
    assert not torch.equal(stages[0], stages[2])  # stage 1 draws from seed + 100
    _check_partitioned_checkpoint(groups)
    _check_deepspeed_checkpointing(groups)


@pytest.mark.distributed
def test_tracker_masks_and_partitioned_checkpoint_tp2_pp2():
    run_distributed(_random_world4, 4)
