"""DeepSpeed's process group and its CPU ops.

``init_process_group`` is ``deepspeed.init_distributed`` (which also gives DeepSpeed's ``comm`` its
backend) with DeepSpeed's per-rank "built successfully" chatter kept off the console, then points
DeepSpeed's torch backend at torch's current collective names (a declared replacement).
"""
import contextlib
import io
import os

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator

from megatron.training.dist_utils import print_line
from megatron.training.engine.replacements import replace

CPU_OPS = {"ShareMemCommBuilder": "shared-memory collectives (every run)",
           "CPUAdamBuilder": "CPU Adam (ZeRO optimizer offload)"}


def unbuilt_cpu_op(name: str):
    """(DeepSpeed's op builder, its cache directory) when the CPU op ``name`` still has to be compiled, else None."""
    from torch.utils.cpp_extension import _get_build_directory

    builder = get_accelerator().create_op_builder(name)
    if builder is None:
        return None
    directory = _get_build_directory(builder.NAME, verbose=False)
    return None if os.path.exists(os.path.join(directory, f"{builder.NAME}.so")) else (builder, directory)


def build_deepspeed_cpu_ops() -> None:
    """Compile DeepSpeed's CPU ops not yet in torch's extensions cache, saying so first (the install
    script runs this, so that no run waits for it)."""
    for name, purpose in CPU_OPS.items():
        unbuilt = unbuilt_cpu_op(name)
        if unbuilt is not None:
            builder, directory = unbuilt
            print_line(f"building DeepSpeed's {purpose} op for the CPU, once (a minute or two on two cores; "
                       f"cached in {directory}) ...")
            builder.load(verbose=False)


def announce_cpu_op_build(rank: int) -> None:
    """Before DeepSpeed's CPU accelerator compiles its shared-memory op (when the install did not),
    say why the next minute is quiet."""
    unbuilt = unbuilt_cpu_op("ShareMemCommBuilder")
    if unbuilt is not None and rank == 0:
        print_line(f"> DeepSpeed builds its shared-memory op for the CPU once (about a minute on two cores; "
                   f"cached in {unbuilt[1]}) ...")


def use_current_collective_names() -> None:
    """DeepSpeed 0.19 calls torch.distributed.all_gather_into_tensor and reduce_scatter_tensor, which
    torch deprecates (a FutureWarning on every rank) for all_gather_single and reduce_scatter_single,
    the same collectives under their current names: point DeepSpeed's torch backend at those where
    this torch has them."""
    import deepspeed.comm.comm as deepspeed_comm

    backend = deepspeed_comm.cdb
    for attribute, current_name in (("all_gather_function", "all_gather_single"),
                                    ("reduce_scatter_function", "reduce_scatter_single")):
        current = getattr(torch.distributed, current_name, None)
        if current is not None and getattr(backend, attribute, None) is not None:
            replace("distributed.use_current_collective_names", backend, attribute, current)


def init_process_group(backend: str, rank: int, world_size: int) -> None:
    """deepspeed.init_distributed from the rendezvous variables already in the environment."""
    if not torch.cuda.is_available():
        announce_cpu_op_build(rank)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # DeepSpeed's CPU backend prints "... built successfully" per rank
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False, rank=rank,
                                   world_size=world_size)
    for line in printed.getvalue().splitlines():
        if not line.endswith(" built successfully"):  # also said when the op only came from the cache
            print_line(line)
    use_current_collective_names()
