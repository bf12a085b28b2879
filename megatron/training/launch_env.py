"""Where this process sits in the job: rank, world size, local rank and rendezvous, from the launcher.

Launchers and what they leave behind (first match wins):

    deepspeed --num_gpus N script     env RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT,
                                      CROSS_RANK/CROSS_SIZE/LOCAL_SIZE; argv --local_rank=i
    torchrun --nproc_per_node N       env RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*, TORCHELASTIC_RUN_ID
    python -m torch.distributed.launch
                                      as torchrun, plus argv --local-rank=i (--local_rank before torch 2.0)
    plain environment                 env RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
                                      (RANK=0 without WORLD_SIZE: Megatron-DeepSpeed's "emulate
                                      distributed", a world of 1)
    srun (SLURM)                      env SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the rendezvous host
                                      is MASTER_ADDR or else the first host of SLURM_JOB_NODELIST
    single process                    nothing: rank 0 of 1 (on a free port unless MASTER_PORT is set)

The torch variables win over SLURM's, so ``srun torchrun ...`` (one torchrun per node, as the
BigScience tr11 job) reads torchrun's ranks. SLURM's own variables are used only when RANK and
WORLD_SIZE are absent, i.e. one srun task per GPU. A batch script that runs python without srun
still carries SLURM_NTASKS of the allocation: launch through srun (or a launcher) there.
"""
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from megatron.training.argument_types import ArgumentError

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 6000  # Megatron's default rendezvous port


class LaunchEnvError(ArgumentError):
    """The launcher's variables are missing or inconsistent; the message names them."""


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the job.

    Attributes:
        rank: global rank in [0, world_size).
        world_size: number of processes.
        local_rank: rank among the processes of this node (selects the GPU).
        master_addr: host of rank 0, where the processes meet.
        master_port: port of that rendezvous.
        source: launcher that set the values: "deepspeed", "torchrun", "torch.distributed.launch",
            "env", "slurm" or "single".
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str

    def torch_env(self) -> dict:
        """The variables torch.distributed's env:// rendezvous reads, for os.environ.update()."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(self.local_rank), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}


def _env_int(env, name, minimum=0):
    text = env[name]
    try:
        value = int(text)
    except ValueError:
        raise LaunchEnvError(f"environment variable {name}={text!r} is not an integer") from None
    if value < minimum:
        raise LaunchEnvError(f"environment variable {name}={value} must be >= {minimum}")
    return value


def first_host(nodelist: str) -> str:
    """First host of a SLURM nodelist: "node[01-04],gpu7" -> "node01", "r[2-3]n[5,7]" -> "r2n5"."""
    text = nodelist.strip()
    depth, end = 0, len(text)
    for index, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = index
            break
    host = text[:end]
    # Each bracket group [a-b,c,...] contributes its first value, zero padding kept.
    host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0].strip(), host)
    if not host or "[" in host or "]" in host:
        raise LaunchEnvError(f"cannot read the first host of SLURM nodelist {nodelist!r}; set MASTER_ADDR")
    return host


def _master(env, world_size, fallback_addr=None):
    addr = env.get("MASTER_ADDR") or fallback_addr
    if addr is None:
        if world_size > 1:
            raise LaunchEnvError(f"MASTER_ADDR is not set for a job of {world_size} processes: set "
                                 f"MASTER_ADDR (host of rank 0) and MASTER_PORT, or use a launcher")
        addr = DEFAULT_MASTER_ADDR
    if env.get("MASTER_PORT"):
        port = _env_int(env, "MASTER_PORT", minimum=1)
    else:  # a lone process meets only itself: any free port, so that two of them on one host do not collide
        port = DEFAULT_MASTER_PORT if world_size > 1 else free_port()
    if port > 65535:
        raise LaunchEnvError(f"environment variable MASTER_PORT={port} is not a port (1-65535)")
    return addr, port


def _local_rank(env, argv_local_rank, rank, world_size):
    """LOCAL_RANK and the argv --local_rank must agree; either one, else rank when alone on a node."""
    env_local = _env_int(env, "LOCAL_RANK") if env.get("LOCAL_RANK") else None
    if env_local is not None and argv_local_rank is not None and env_local != argv_local_rank:
        raise LaunchEnvError(f"--local_rank={argv_local_rank} disagrees with LOCAL_RANK={env_local}; "
                             f"the launcher should set the same value in both")
    local = env_local if env_local is not None else argv_local_rank
    if local is None and env.get("SLURM_LOCALID"):
        local = _env_int(env, "SLURM_LOCALID")
    if local is None:
        if world_size > 1:
            raise LaunchEnvError(f"LOCAL_RANK is not set for rank {rank} of {world_size}: set LOCAL_RANK "
                                 f"(rank on this node) or use a launcher")
        local = 0
    if local < 0:
        raise LaunchEnvError(f"local rank {local} must be >= 0")
    return local


def _torch_launcher_name(env, argv_local_rank):
    if "CROSS_RANK" in env or "LOCAL_SIZE" in env:
        return "deepspeed"
    if argv_local_rank is not None:
        return "torch.distributed.launch"
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    return "env"


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _from_torch_env(env, argv_local_rank):
    if env.get("RANK") and not env.get("WORLD_SIZE"):
        if _env_int(env, "RANK") != 0:
            raise LaunchEnvError(f"RANK={env['RANK']} is set but WORLD_SIZE is not: set WORLD_SIZE (and "
                                 f"LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or use a launcher")
        # Megatron-DeepSpeed's "emulate distributed": RANK=0 (and LOCAL_RANK=0) alone is a world of 1.
        env = {**env, "WORLD_SIZE": "1"}
    for name in ("RANK", "WORLD_SIZE"):
        if not env.get(name):
            other = "WORLD_SIZE" if name == "RANK" else "RANK"
            raise LaunchEnvError(f"{other} is set but {name} is not: set both (and LOCAL_RANK, "
                                 f"MASTER_ADDR, MASTER_PORT) or use a launcher")
    world_size = _env_int(env, "WORLD_SIZE", minimum=1)
    rank = _env_int(env, "RANK")
    _check_rank(rank, world_size, "RANK", "WORLD_SIZE")
    local = _local_rank(env, argv_local_rank, rank, world_size)
    addr, port = _master(env, world_size)
    return LaunchEnv(rank, world_size, local, addr, port, _torch_launcher_name(env, argv_local_rank))


def _from_slurm(env, argv_local_rank):
    world_size = _env_int(env, "SLURM_NTASKS", minimum=1)
    rank = _env_int(env, "SLURM_PROCID")
    _check_rank(rank, world_size, "SLURM_PROCID", "SLURM_NTASKS")
    local = _local_rank(env, argv_local_rank, rank, world_size)
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    addr, port = _master(env, world_size, first_host(nodelist) if nodelist else None)
    return LaunchEnv(rank, world_size, local, addr, port, "slurm")


def _check_rank(rank, world_size, rank_name, size_name):
    if rank >= world_size:
        raise LaunchEnvError(f"{rank_name}={rank} is out of range for {size_name}={world_size}")


def read_launch_env(env: Mapping[str, str], argv_local_rank: int | None = None) -> LaunchEnv:
    """Rank, world size, local rank and rendezvous of this process; see the module docstring.

    ``env`` is the process environment (os.environ or a test dict); ``argv_local_rank`` the value
    of --local_rank / --local-rank when a launcher passed one.
    """
    if env.get("RANK") or env.get("WORLD_SIZE"):
        return _from_torch_env(env, argv_local_rank)
    if env.get("SLURM_PROCID") and env.get("SLURM_NTASKS"):
        return _from_slurm(env, argv_local_rank)
    local = argv_local_rank if argv_local_rank is not None else 0
    addr, port = _master(env, 1)
    return LaunchEnv(0, 1, local, addr, port, "single")


def rank_in_environment(env: Mapping[str, str]) -> int:
    """This process's global rank as far as the environment tells before any checking: RANK, else
    SLURM_PROCID, else 0. For deciding who prints an error that every rank meets alike."""
    for name in ("RANK", "SLURM_PROCID"):
        text = env.get(name, "")
        if text.strip().isdigit():
            return int(text)
    return 0


# How many processes a launcher started on this node: torchrun's variable, then the deepspeed launcher's.
LOCAL_PROCESS_COUNT_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")


def threads_per_process(env: Mapping[str, str], cpu_count: int) -> tuple[int, int] | None:
    """(threads, processes on this node) for torch's CPU thread pool when the user did not choose
    (OMP_NUM_THREADS unset or empty) and a launcher started several processes here; else None.

    Each process gets its share of the ``cpu_count`` CPUs it may run on: torch's default, every
    core for every process, oversubscribes the node (the deepspeed launcher sets no thread count;
    torchrun sets 1)."""
    if env.get("OMP_NUM_THREADS"):
        return None
    for name in LOCAL_PROCESS_COUNT_VARIABLES:
        text = env.get(name, "")
        if text.strip().isdigit() and int(text) > 1:
            processes = int(text)
            return max(1, cpu_count // processes), processes
    return None


def effective_backend(requested: str, cuda_available: bool, explicit: bool = True) -> tuple[str, str | None]:
    """(backend, notice): nccl needs CUDA, so without it gloo runs instead. The one-line notice is
    for a user who asked for nccl (``explicit``); the default nccl switches to gloo silently."""
    if requested == "nccl" and not cuda_available:
        notice = ("--distributed-backend nccl: no CUDA device here, using gloo (and DeepSpeed's CPU "
                  "accelerator)") if explicit else None
        return "gloo", notice
    return requested, None
