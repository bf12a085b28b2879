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
``CheckpointWithoutOutput`` also keeps no copy of the function's output: its consumers save a recipe
instead, which their backward turns into the recomputed output (selective recompute).
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


def _replay(rng_states, function, args, inputs):
    """function(*args) with grad enabled, the tensor arguments (``_TENSOR_ARG`` places) taken from
    ``inputs`` in order, under the RNG states of its first run (the default generators' and the
    tracker's); the current states are restored afterwards."""
    remaining = iter(inputs)
    args = [next(remaining) if arg is _TENSOR_ARG else arg for arg in args]
    current = (_current_states(), get_rng_tracker().get_states())
    _restore_states(rng_states[0])
    get_rng_tracker().set_states(rng_states[1])
    try:
        with torch.enable_grad():
            return function(*args)
    finally:
        _restore_states(current[0])
        get_rng_tracker().set_states(current[1])


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
        outputs = _replay(ctx.rng_states, ctx.run_function, ctx.args, inputs)

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
    """y = f(*args) saving only the tensor arguments; backward differentiates the recomputation that
    ``CheckpointWithoutOutput`` made when a consumer unpacked y (or makes it now)."""

    @staticmethod
    def forward(ctx, owner, *args):
        ctx.owner, owner.ctx = owner, ctx
        with torch.no_grad():
            output = owner.function(*args)
        ctx.args = [_TENSOR_ARG if torch.is_tensor(arg) else arg for arg in args]
        ctx.save_for_backward(*[arg for arg in args if torch.is_tensor(arg)])
        return output

    @staticmethod
    def backward(ctx, grad):
        owner, ctx.owner = ctx.owner, None
        inputs, output = owner.recomputed()
        if output.requires_grad:
            torch.autograd.backward(output, grad)
        input_grads = iter(t.grad if t.requires_grad else None for t in inputs)
        return (None,) + tuple(next(input_grads) if arg is _TENSOR_ARG else None for arg in ctx.args)


class _SavedView(NamedTuple):
    """What a consumer saved of a CheckpointWithoutOutput's output: where its view lies in the output."""

    owner: "CheckpointWithoutOutput"
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


class _PackedOutside(NamedTuple):
    """A tensor packed by the saved-tensor hooks that were active around ``consumers()``."""

    unpack: Callable[[Any], torch.Tensor]
    packed: Any


def _enclosing_saved_tensor_hooks():
    """The (pack, unpack) hooks active now, or None."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


class CheckpointWithoutOutput:
    """y = f(*args) of which autograd keeps neither f's activations nor y.

    y's consumers (a linear layer keeps its input for the weight gradient) run in ``consumers()``::

        recompute = CheckpointWithoutOutput()
        y = recompute.checkpoint(f, x)      # runs f without autograd, keeps x
        with recompute.consumers():
            z = consumer(y)                 # keeps how to make y again instead of y

    so y's memory is free once the forward has moved on. When the consumer's backward needs y, f runs
    again on x under the forward's RNG states (dropout masks repeat bit-exactly), with autograd, and
    the consumer gets the result (or its view of it) without a copy; f's backward then differentiates
    that recomputation. Without grad mode everything runs plainly.
    """

    def __init__(self):
        self.function = None
        self.ctx = None
        self._rng_states = None
        self._where = None  # the output's storage address, its offset in it, the storage's bytes
        self._recomputation = None

    def checkpoint(self, function: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        """``function(*args)`` (one tensor), kept only by consumers that run outside ``consumers()``."""
        if not torch.is_grad_enabled():
            return function(*args)
        self.function = function
        self._rng_states = (_current_states(), get_rng_tracker().get_states())
        output = _OutputRecomputedFunction.apply(self, *args)
        storage = output.untyped_storage()
        self._where = (storage.data_ptr(), output.storage_offset(), storage.nbytes())
        return output

    @contextlib.contextmanager
    def consumers(self) -> Iterator[None]:
        """Run the output's consumers: what they save of it becomes a recipe for recomputing it.
        Other saved tensors go to the hooks active outside, if any, unchanged otherwise."""
        if self._where is None:
            yield
            return
        outside = _enclosing_saved_tensor_hooks()
        address, base_offset, nbytes = self._where

        def pack(tensor):
            if address <= tensor.data_ptr() < address + nbytes and tensor.layout is torch.strided \
                    and tensor.untyped_storage().data_ptr() == address:
                return _SavedView(self, tensor.storage_offset() - base_offset, tensor.size(), tensor.stride())
            if outside is not None:
                return _PackedOutside(outside[1], outside[0](tensor))
            return tensor.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield

    def view(self, saved: _SavedView) -> torch.Tensor:
        """The consumer's saved view of the output, made again (once for all the consumers)."""
        if self._recomputation is None:
            self._recomputation = self._recompute()
        output = self._recomputation[1].detach()
        return output.as_strided(saved.size, saved.stride, output.storage_offset() + saved.offset)

    def _recompute(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        ctx = self.ctx
        inputs = [saved.detach().requires_grad_(saved.requires_grad) for saved in ctx.saved_tensors]
        return inputs, _replay(self._rng_states, self.function, ctx.args, inputs)

    def recomputed(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(inputs, output) of the recomputation for f's backward (made now if no consumer unpacked
        the output), then forgotten."""
        recomputation = self._recomputation if self._recomputation is not None else self._recompute()
        self._recomputation = self.ctx = None
        return recomputation


def _unpack(saved: Any) -> torch.Tensor:
    if isinstance(saved, _SavedView):
        return saved.owner.view(saved)
    if isinstance(saved, _PackedOutside):
        return saved.unpack(saved.packed)
    return saved
