"""Model-parallel RNG streams and activation checkpointing that replays them.

Two streams drive dropout (and on-device init):
    default generator      seed + 100 * pp_rank                   same on all TP ranks of a stage:
                                                                  replicated tensors ([s, b, h] after
                                                                  a row-parallel layer) get equal masks
    "model-parallel-rng"   seed + 100 * pp_rank + 2718 + tp_rank  differs across TP ranks: split tensors
                                                                  (attention heads) get independent masks
Code that touches split tensors runs inside ``get_rng_tracker().fork()``. A stream is the state of the
CPU generator and, when CUDA is available, of the current CUDA device's generator.

``checkpoint`` drops the activations of a function in forward and recomputes them in backward,
restoring both streams first, so the recomputation draws the same dropout masks (bit-exact).
``CheckpointWithoutOutput`` also frees the function's output once its consumer has saved it, and
refills it when the consumer's backward is about to run (selective recompute).
"""
import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch.distributed import ProcessGroup

from megatron.core.parallel_state import group_size
from megatron.core.tensor_parallel.utils import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TENSOR_ARG = object()  # placeholder for a tensor argument in the saved non-tensor arguments


class _GeneratorStates(NamedTuple):
    cpu: torch.Tensor
    cuda: torch.Tensor | None


def _current_states() -> _GeneratorStates:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return _GeneratorStates(torch.get_rng_state(), cuda)


def _restore_states(states: _GeneratorStates) -> None:
    torch.set_rng_state(states.cpu)
    if states.cuda is not None:
        torch.cuda.set_rng_state(states.cuda)


class RNGStatesTracker:
    """Named generator states that code can switch to temporarily with ``fork(name)``.

    The interface (add, fork, get_states, set_states, reset) is the one DeepSpeed's activation
    checkpointing expects of its tracker (the engine shares this one with it).
    """

    def __init__(self):
        self._states: dict[str, _GeneratorStates] = {}
        self._seeds: set[int] = set()

    def reset(self) -> None:
        self._states, self._seeds = {}, set()

    def get_states(self) -> dict[str, _GeneratorStates]:
        """A copy of the name -> state map (the states themselves are immutable snapshots)."""
        return dict(self._states)

    def set_states(self, states: dict[str, _GeneratorStates]) -> None:
        self._states = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``, leaving the current generators untouched."""
        if seed in self._seeds:
            raise ValueError(f"RNG tracker: seed {seed} is already used by another stream")
        if name in self._states:
            raise ValueError(f"RNG tracker: stream {name!r} already exists (call reset() to reseed)")
        cuda = None
        if torch.cuda.is_available():
            outer = torch.cuda.get_rng_state()
            torch.cuda.manual_seed(seed)
            cuda = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(outer)
        self._states[name] = _GeneratorStates(torch.Generator().manual_seed(seed).get_state(), cuda)
        self._seeds.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block on stream ``name``; on exit save its advanced state and restore the outer one."""
        if name not in self._states:
            raise ValueError(f"RNG tracker: stream {name!r} was never added; call "
                             f"model_parallel_seed(seed, tp_rank, pp_rank) before building or running the model")
        outer = _current_states()
        _restore_states(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _current_states()
            _restore_states(outer)


_RNG_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker (RNG state is process-wide, like torch's own generators)."""
    return _RNG_TRACKER


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int) -> None:
    """Seed the default generators with seed + 100 * pp_rank and the tracker's model-parallel
    stream with seed + 100 * pp_rank + 2718 + tp_rank (Megatron's values)."""
    stage_seed = seed + 100 * pp_rank
    torch.manual_seed(stage_seed)
    tracker = get_rng_tracker()
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, stage_seed + 2718 + tp_rank)


class _CheckpointFunction(torch.autograd.Function):
    """Forward without saving activations; backward recomputes them under the forward's RNG states.

    With a partition group, each floating-point tensor input is saved as this rank's 1/k chunk and
    all-gathered before recomputation (the inputs must be replicated across the group).
    """

    @staticmethod
    def forward(ctx, run_function, partition_group, *args):
        ctx.run_function, ctx.partition_group = run_function, partition_group
        ctx.rng_states = (_current_states(), get_rng_tracker().get_states())
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.args = [_TENSOR_ARG if torch.is_tensor(arg) else arg for arg in args]
        tensors = [arg for arg in args if torch.is_tensor(arg)]
        ctx.tensor_meta = [(t.shape, t.requires_grad, _is_partitioned(t, partition_group)) for t in tensors]
        ctx.save_for_backward(*[split_tensor_into_1d_equal_chunks(t, partition_group)
                                if _is_partitioned(t, partition_group) else t for t in tensors])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        inputs = []
        for saved, (shape, requires_grad, partitioned) in zip(ctx.saved_tensors, ctx.tensor_meta):
            if partitioned:
                saved = gather_split_1d_tensor(saved, ctx.partition_group, shape.numel()).view(shape)
            inputs.append(saved.detach().requires_grad_(requires_grad))
        remaining = iter(inputs)
        args = [next(remaining) if arg is _TENSOR_ARG else arg for arg in ctx.args]

        backward_states = (_current_states(), get_rng_tracker().get_states())
        _restore_states(ctx.rng_states[0])
        get_rng_tracker().set_states(ctx.rng_states[1])
        try:
            with torch.enable_grad():
                outputs = ctx.run_function(*args)
        finally:
            _restore_states(backward_states[0])
            get_rng_tracker().set_states(backward_states[1])

        outputs = (outputs,) if torch.is_tensor(outputs) else tuple(outputs)
        pairs = [(out, grad) for out, grad in zip(outputs, grads)
                 if torch.is_tensor(out) and out.requires_grad and grad is not None]
        torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        input_grads = iter(t.grad for t in inputs)
        return (None, None) + tuple(next(input_grads) if arg is _TENSOR_ARG else None for arg in ctx.args)


def _is_partitioned(tensor: torch.Tensor, group: ProcessGroup | None) -> bool:
    return group_size(group) > 1 and tensor.is_floating_point()


def checkpoint(function: Callable[..., Any], distribute_saved_activations: bool, *args: Any,
               tp_group: ProcessGroup | None = None) -> Any:
    """``function(*args)`` with activation checkpointing (recomputation in backward, RNG replayed).

    ``distribute_saved_activations`` (DeepSpeed's partitioned activations, Megatron-DeepSpeed's
    ``--partition-activations``) keeps only a 1/k share of each floating-point input on each of the k
    ranks of ``tp_group`` and all-gathers it in backward; the inputs must then be replicated across
    the TP group (true of the [s, b, h] hidden states). The full input's memory is released once the
    caller drops its own reference to it. At least one tensor argument must require
    grad when grad is enabled, otherwise the parameters inside would get no gradient.
    """
    if not torch.is_grad_enabled():
        return function(*args)
    if not any(torch.is_tensor(arg) and arg.requires_grad for arg in args):
        raise ValueError("checkpoint: no tensor argument requires grad, so the parameters inside the "
                         "checkpointed function would get no gradient; pass the activations that require grad")
    partition_group = tp_group if distribute_saved_activations else None
    return _CheckpointFunction.apply(function, partition_group, *args)


class _OutputRecomputedFunction(torch.autograd.Function):
    """y = f(*args) saving only the tensor arguments; backward takes the recomputation that
    ``CheckpointWithoutOutput`` made (when the consumer's gradient arrived) and differentiates it."""

    @staticmethod
    def forward(ctx, owner, *args):
        ctx.owner = owner
        with torch.no_grad():
            output = owner.function(*args)
        ctx.args = [_TENSOR_ARG if torch.is_tensor(arg) else arg for arg in args]
        ctx.save_for_backward(*[arg for arg in args if torch.is_tensor(arg)])
        return output

    @staticmethod
    def backward(ctx, grad):
        owner, ctx.owner = ctx.owner, None
        inputs, output = owner.recomputed(ctx)
        if output.requires_grad:
            torch.autograd.backward(output, grad)
        input_grads = iter(t.grad if t.requires_grad else None for t in inputs)
        return (None,) + tuple(next(input_grads) if arg is _TENSOR_ARG else None for arg in ctx.args)


class CheckpointWithoutOutput:
    """y = f(*args) that keeps neither f's activations nor, after ``discard_output``, y itself.

    The consumer of y (a linear layer, say) saves y for its own backward. Then::

        recompute = CheckpointWithoutOutput()
        y = recompute.checkpoint(f, x)      # runs f without autograd, saves x
        z = consumer(y)                     # saves y
        recompute.discard_output(z)         # frees y's storage

    When z's gradient is computed, before the consumer's backward runs, f is run again on x under
    the forward's RNG states (dropout masks repeat bit-exactly) and the result is copied into y's
    storage; f's backward then differentiates that recomputation. ``f`` must return one fresh
    contiguous tensor (its own storage). Without grad mode everything runs plainly.
    """

    def __init__(self):
        self.function = None
        self.output = None
        self._rng_states = None
        self._recomputation = None

    def checkpoint(self, function: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        """``function(*args)``, its output kept until ``discard_output``."""
        if not torch.is_grad_enabled():
            return function(*args)
        self.function = function
        self._rng_states = (_current_states(), get_rng_tracker().get_states())
        self.output = _OutputRecomputedFunction.apply(self, *args)
        return self.output

    def discard_output(self, consumer_output: torch.Tensor) -> None:
        """Free the output's storage; refill it when ``consumer_output``'s gradient is computed."""
        if self.output is None or not consumer_output.requires_grad:
            return
        self.output.untyped_storage().resize_(0)
        consumer_output.register_hook(self._refill)

    def _refill(self, grad: torch.Tensor) -> None:
        ctx = self.output.grad_fn
        inputs, recomputed = self._recompute(ctx)
        storage = self.output.untyped_storage()
        storage.resize_(recomputed.untyped_storage().size())
        with torch.no_grad():
            storage.copy_(recomputed.untyped_storage())
        self._recomputation = (inputs, recomputed)
        self.output = None

    def _recompute(self, ctx) -> tuple[list[torch.Tensor], torch.Tensor]:
        inputs = [saved.detach().requires_grad_(saved.requires_grad) for saved in ctx.saved_tensors]
        remaining = iter(inputs)
        args = [next(remaining) if arg is _TENSOR_ARG else arg for arg in ctx.args]
        backward_states = (_current_states(), get_rng_tracker().get_states())
        _restore_states(self._rng_states[0])
        get_rng_tracker().set_states(self._rng_states[1])
        try:
            with torch.enable_grad():
                output = self.function(*args)
        finally:
            _restore_states(backward_states[0])
            get_rng_tracker().set_states(backward_states[1])
        return inputs, output

    def recomputed(self, ctx) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(inputs, output) of the recomputation made for backward (made now if the output was never
        discarded), then forgotten."""
        recomputation = self._recomputation if self._recomputation is not None else self._recompute(ctx)
        self._recomputation = self.function = self.output = self._rng_states = None
        return recomputation
