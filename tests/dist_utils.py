"""Run a test function on several CPU processes joined in a gloo process group.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes; each initialises
``torch.distributed`` with the gloo backend, calls ``fn(rank, world_size, *args)`` and tears the
group down. ``backend="nccl"`` (GPU tests) gives rank r the GPU r instead. A failure in any rank fails the test with that rank's traceback. ``fn`` must be a
module-level function so that it can be pickled.
"""
import os
import socket
import traceback

import torch.multiprocessing as mp


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, errors, backend):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size, *args, backend="gloo"):
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_worker, args=(world_size, free_port(), fn, args, errors, backend),
                           nprocs=world_size, join=True, start_method="spawn")
    except Exception as exc:
        details = []
        while not errors.empty():
            rank, tb = errors.get()
            details.append(f"--- rank {rank} ---\n{tb}")
        raise AssertionError("distributed test failed\n" + "\n".join(details)) from exc
