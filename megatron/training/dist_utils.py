"""The trainer's own collectives: loss averaging, flags agreed across ranks, maxima, barriers, printing.

The model's collectives live in megatron/core/tensor_parallel/mappings.py; these are the few the
loop needs around it (docs/architecture.md, "Principles"). Every function is the identity on a single process
without torch.distributed, so the loop's code is the same for one process and for many.

Reductions run on the device the backend requires: the current CUDA device under NCCL, the CPU
under gloo. Values travel as float64, so counters up to 2**53 and fp32 losses pass exactly.
"""
import datetime
import hashlib
import math
import os
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def is_rank_0() -> bool:
    return rank() == 0


def is_last_rank() -> bool:
    """The rank that prints the log line and writes TensorBoard, as in Megatron-DeepSpeed (world_size - 1)."""
    return rank() == world_size() - 1


def print_line(message: str) -> None:
    """Print ``message`` and its newline in one write, so lines of concurrent ranks sharing a
    terminal or a log file do not interleave (print() writes the text and the newline apart when
    stdout is unbuffered)."""
    print(message + "\n", end="", flush=True)


def print_rank_0(message: str) -> None:
    if is_rank_0():
        print_line(message)


def print_rank_last(message: str) -> None:
    if is_last_rank():
        print_line(message)


def _device() -> torch.device:
    if distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(values: Sequence[float], op, group) -> list[float]:
    if not distributed():
        return [float(v) for v in values]
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_device())
    dist.all_reduce(tensor, op=op, group=group)
    return tensor.tolist()


def average_across_group(values: Sequence[float], group=None) -> list[float]:
    """Element-wise mean of ``values`` over the ranks of ``group`` (default: the world).

    The trainer averages each micro-batch-mean loss over the data-parallel group, as Megatron-DeepSpeed's
    ``average_losses_across_data_parallel_group`` does. A NaN or inf on any rank makes that entry
    NaN/inf everywhere.
    """
    size = dist.get_world_size(group) if distributed() else 1
    return [total / size for total in _all_reduce(values, dist.ReduceOp.SUM, group)]


def sum_across_group(values: Sequence[float], group=None) -> list[float]:
    """Element-wise sum of ``values`` over the ranks of ``group`` (default: the world)."""
    return _all_reduce(values, dist.ReduceOp.SUM, group)


def max_across_ranks(value: float, group=None) -> float:
    """The largest ``value`` of any rank: e.g. elapsed minutes, so that all ranks stop together."""
    return _all_reduce([value], dist.ReduceOp.MAX, group)[0]


def max_each_across_ranks(values: Sequence[float], group=None) -> list[float]:
    """Element-wise maximum of ``values`` over the ranks of ``group``: several decisions in one collective."""
    return _all_reduce(values, dist.ReduceOp.MAX, group)


def any_rank_true(flag: bool, group=None) -> bool:
    """True on every rank when ``flag`` is True on at least one: a decision all ranks share
    (the kill switch is seen by whichever rank's file system sees it first)."""
    return max_across_ranks(1.0 if flag else 0.0, group) > 0.0


def gather_objects(value, group=None) -> list:
    """Every rank's ``value`` (picklable), in rank order, on every rank of ``group``."""
    if not distributed():
        return [value]
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def broadcast_object_from_rank_0(value):
    """Global rank 0's ``value`` (picklable; ignored elsewhere) on every rank: what rank 0 alone read
    (a prompt typed in, a request received) handed to all."""
    if not distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_from_first_rank(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The first rank of ``group``'s ``tensor`` on every rank of it (a new tensor; ``tensor`` is kept)."""
    if not distributed():
        return tensor.clone()
    received = tensor.clone().contiguous()
    source = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(received, src=source, group=group)
    return received


def barrier(group=None) -> None:
    if not distributed():
        return
    if dist.get_backend() == "nccl":  # name the device, as NCCL otherwise guesses it (with a warning)
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


def shutdown() -> None:
    """Wait for every rank, then tear the process group down, so no rank exits while another still
    talks to it (gloo aborts a process whose peers vanished mid-collective)."""
    if distributed():
        barrier()
        dist.destroy_process_group()


# How gloo reports a peer process that has gone (exited, killed, or stopped by its launcher) mid-collective.
PEER_LOST_MESSAGES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def peer_lost(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is a collective failing because another
    rank's process has gone: that rank's own error explains the stop, this one adds nothing."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, RuntimeError) and any(text in str(error) for text in PEER_LOST_MESSAGES):
            return True
        error = error.__cause__ or error.__context__
    return False


def first_to_report(message: str) -> bool:
    """Whether this rank is the first of the job to report ``message`` (an error several ranks may
    meet at once): an atomic counter in the job's rendezvous store, the TCPStore at MASTER_ADDR:
    MASTER_PORT. True when there is no store to ask (one process, or the store's host has gone)."""
    if not distributed() or world_size() == 1:
        return True
    key = "megatron/reported/" + hashlib.sha256(message.encode()).hexdigest()[:16]
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=5))
        return store.add(key, 1) == 1
    except (RuntimeError, KeyError, ValueError):
        return True


def params_l2_norm(named_parameters: Iterable[tuple[str, torch.Tensor]], tp_rank: int, data_parallel_size: int,
                   counts_here: Callable[[str], bool]) -> float:
    """L2 norm of all distinct parameters of the model (the log line's ``params norm``); collective.

    Each rank adds the squares of its share: a TP-split parameter (``tensor_model_parallel`` True)
    on every TP rank (the slices are disjoint), a replicated one on TP rank 0 only, and only where
    ``counts_here(name)`` (which excludes the pipeline's second copy of the tied embedding). The
    world's sum counts every model replica, i.e. ``data_parallel_size`` times the model.
    """
    squares = [param.detach().float().pow(2).sum() for name, param in named_parameters
               if (getattr(param, "tensor_model_parallel", False) or tp_rank == 0) and counts_here(name)]
    share = float(torch.stack(squares).sum()) if squares else 0.0
    return math.sqrt(sum_across_group([share])[0] / data_parallel_size)
