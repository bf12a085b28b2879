"""Run a test function on several CPU processes joined in a gloo process group.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes; each initialises
``torch.distributed`` with the gloo backend, calls ``fn(rank, world_size, *args)`` and tears the
group down. ``backend="nccl"`` (GPU tests) gives rank r the GPU r instead. A failure in any rank fails the test with that rank's traceback. ``fn`` must be a
module-level function so that it can be pickled.

gloo workers fork from multiprocessing's fork server, a fresh interpreter started once per session
that has imported torch and megatron.core (FORKSERVER_PRELOAD): a spawned worker spends seconds of
a 2-core machine importing them again, each time. The server holds no state of the test process;
each worker gets the test process's current environment (the server keeps the one it started
with), working directory and sys.path, as a spawned one does, and sets the environment before it
imports ``fn``'s module (``fn`` travels pickled): DeepSpeed, for one, picks its accelerator when
imported. NCCL workers are spawned: CUDA does not survive a fork.
"""
import os
import pickle
import socket
import traceback

import torch.multiprocessing as mp

FORKSERVER_PRELOAD = ["torch", "torch.distributed", "megatron.core.parallel_state", "megatron.core.tensor_parallel",
                      "megatron.core.models.gpt"]


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, call, errors, backend, environment):
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    fn, args = pickle.loads(call)
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
    start_method = "spawn" if backend == "nccl" else "forkserver"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # read once, when the server starts
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_worker, args=(world_size, free_port(), pickle.dumps((fn, args)), errors, backend,
                                          dict(os.environ)), nprocs=world_size, join=True, start_method=start_method)
    except Exception as exc:
        details = []
        while not errors.empty():
            rank, tb = errors.get()
            details.append(f"--- rank {rank} ---\n{tb}")
        raise AssertionError("distributed test failed\n" + "\n".join(details)) from exc
