"""Start-up of a training process: accelerator, process group, model-parallel groups, seeds, log levels.

    select_accelerator()                       # before anything imports deepspeed
    parsed = parse_args(); config = build_config(parsed, vocab_size)
    groups = initialize_megatron(config)       # torch.distributed + TP/DP/PP groups + seeds

DeepSpeed chooses its accelerator when it is first imported. Without CUDA we set
``DS_ACCELERATOR=cpu`` first, so DeepSpeed runs on its CPU accelerator with gloo (the arguments
module already replaced nccl by gloo). On its first start there, DeepSpeed compiles a small
shared-memory op (about a minute on two cores, cached in torch's extensions directory); the
trainer says so before the wait. Unless ``TORCH_EXTENSIONS_DIR`` is set, that directory is one per
Python environment: torch's default is one per user, and environments sharing it overwrite each
other's build files, so each would rebuild DeepSpeed's ops after another one ran.

Rank, world size and rendezvous come from the launcher's environment as the arguments module read
it (deepspeed, torchrun, torch.distributed.launch, SLURM srun, plain variables, or none at all for
a single process); they are written back to the environment torch's env:// rendezvous reads, so a
lone ``python pretrain_gpt.py ...`` becomes rank 0 of 1 on a local address. Unless OMP_NUM_THREADS
says otherwise, the processes a launcher started on one node share its CPUs (the deepspeed launcher
sets no thread count, and every process taking every core runs a 2-process CPU job at half speed).
"""
import hashlib
import importlib.util
import logging
import os
import random
import sys
from typing import TYPE_CHECKING

import numpy as np
import torch

from megatron.core.models.gpt import GPTModelConfig
from megatron.core.parallel_state import ParallelGroups, initialize_model_parallel
from megatron.core.tensor_parallel import model_parallel_seed
if TYPE_CHECKING:  # the config module imports deepspeed, which must wait for select_accelerator
    from megatron.training.config import LoggingConfig, ProcessLayout
from megatron.training.dist_utils import print_line, print_rank_0
from megatron.training.launch_env import threads_per_process

ACCELERATOR_ENV = "DS_ACCELERATOR"
EXTENSIONS_DIR_ENV = "TORCH_EXTENSIONS_DIR"
LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
              "error": logging.ERROR, "critical": logging.CRITICAL}
# Loggers whose level --log-level / --log-level-replica set: ours, DeepSpeed's, transformers'.
LOGGER_NAMES = ("megatron", "DeepSpeed", "transformers")


def select_accelerator(cuda_available: bool | None = None) -> str:
    """Set DS_ACCELERATOR=cpu when there is no CUDA device (unless the user chose one); return it.
    Also gives this environment its own extensions directory (``use_environment_extensions_dir``).

    Must run before deepspeed is imported, which fixes the accelerator for the process.
    """
    use_environment_extensions_dir()
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if not cuda_available and not os.environ.get(ACCELERATOR_ENV):
        os.environ[ACCELERATOR_ENV] = "cpu"
    return os.environ.get(ACCELERATOR_ENV, "cuda")


def use_environment_extensions_dir() -> str:
    """Point TORCH_EXTENSIONS_DIR at this Python environment's own directory unless the user set it; return it.

    The directory sits under torch's default root, named after the Python and torch versions and a
    hash of ``sys.prefix``, so the install script builds DeepSpeed's ops where the runs look for them.
    """
    if not os.environ.get(EXTENSIONS_DIR_ENV):
        from torch.utils.cpp_extension import get_default_build_root

        prefix_hash = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]
        name = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}_{prefix_hash}"
        os.environ[EXTENSIONS_DIR_ENV] = os.path.join(get_default_build_root(), name)
    return os.environ[EXTENSIONS_DIR_ENV]


def _rendezvous_environment(parallel: "ProcessLayout") -> dict:
    return {"RANK": str(parallel.rank), "WORLD_SIZE": str(parallel.world_size),
            "LOCAL_RANK": str(parallel.local_rank), "MASTER_ADDR": parallel.master_addr,
            "MASTER_PORT": str(parallel.master_port)}


CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"


def use_deterministic_algorithms() -> None:
    """--deterministic: torch raises on any nondeterministic kernel rather than run it; cuBLAS gets the
    fixed workspace its deterministic mode needs (before its first call); cuDNN no autotuning."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC_WORKSPACE
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def share_cpu_threads(rank: int) -> None:
    """Without OMP_NUM_THREADS, give each process of this node its share of the CPUs it may run on
    (launch_env.threads_per_process); rank 0 says so in one line."""
    choice = threads_per_process(os.environ, len(os.sched_getaffinity(0)))
    if choice is None:
        return
    threads, processes = choice
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # for the processes this one starts
    if rank == 0:
        print_line(f"> OMP_NUM_THREADS is not set: {threads} CPU thread(s) per process ({processes} processes on "
                   f"this node); set OMP_NUM_THREADS to choose")


def initialize_distributed(parallel: "ProcessLayout") -> ParallelGroups:
    """CPU threads per process, torch.cuda.set_device(local rank) on GPU, the engine's process group
    (engine/distributed.py), then our TP/DP/PP groups."""
    from megatron.training.engine.distributed import init_process_group

    share_cpu_threads(parallel.rank)
    if parallel.deterministic:
        use_deterministic_algorithms()
    os.environ.update(_rendezvous_environment(parallel))
    if torch.cuda.is_available():
        device_count = torch.cuda.device_count()
        torch.cuda.set_device(parallel.local_rank % device_count)
    if parallel.rank == 0:  # torch.distributed does not know the rank yet
        print_line(f"> initializing torch distributed with backend {parallel.distributed_backend}, "
                   f"world size {parallel.world_size} (launcher: {parallel.launcher}) ...")
    init_process_group(parallel.distributed_backend, parallel.rank, parallel.world_size)
    print_rank_0(f"> initializing tensor model parallel with size {parallel.tensor_model_parallel_size}")
    print_rank_0(f"> initializing pipeline model parallel with size {parallel.pipeline_model_parallel_size}")
    # inference's ProcessLayout has no DeepSpeed-Ulysses degree
    sequence_parallel_size = getattr(parallel, "sequence_parallel_size", 1)
    if sequence_parallel_size > 1:
        print_rank_0(f"> initializing DeepSpeed-Ulysses sequence parallel with size {sequence_parallel_size}")
    return initialize_model_parallel(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                                     sequence_parallel_size)


SEQUENCE_PARALLEL_SEED_STRIDE = 7919  # a prime, away from the stride of 100 per pipeline stage


def set_random_seeds(seed: int, groups: ParallelGroups) -> None:
    """python, numpy and torch seeded with seed + 100 * pp_rank; the TP tracker's stream as well
    (megatron.core.tensor_parallel.model_parallel_seed). DeepSpeed's activation checkpointing is
    pointed at our tracker, so any recomputation it runs replays the model-parallel dropout masks.
    The ranks of a DeepSpeed-Ulysses group hold other positions (and, in attention, other heads) of
    the same samples: torch's streams start SEQUENCE_PARALLEL_SEED_STRIDE x sp_rank further, so their
    dropout masks are independent (their initial weights are SP rank 0's, which DeepSpeed broadcasts)."""
    stage_seed = seed + 100 * groups.pp_rank
    print_rank_0(f"> setting random seeds to {seed} ...")
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    from megatron.training.engine.activation_checkpointing import share_rng_tracker

    model_parallel_seed(seed + SEQUENCE_PARALLEL_SEED_STRIDE * groups.sp_rank, groups.tp_rank, groups.pp_rank)
    share_rng_tracker()


def apply_log_levels(logging_config: "LoggingConfig", global_rank: int) -> None:
    """--log-level on rank 0, --log-level-replica elsewhere, for our, DeepSpeed's and transformers' loggers."""
    name = logging_config.log_level if global_rank == 0 else logging_config.log_level_replica
    if name is None:
        return
    if name not in LOG_LEVELS:
        raise ValueError(f"--log-level{'' if global_rank == 0 else '-replica'} {name!r}: use one of "
                         f"{sorted(LOG_LEVELS)}")
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    for logger_name in LOGGER_NAMES:
        logging.getLogger(logger_name).setLevel(LOG_LEVELS[name])


class FusedKernelConstraintError(RuntimeError):
    """--abort-on-unmet-fused-kernel-constraints: a fused kernel would fall back to its reference."""


def fused_kernel_violations(model: GPTModelConfig, tensor_model_parallel_size: int,
                            micro_batch_size: int) -> list[str]:
    """Why a fused kernel the model uses would fall back to its reference at the configured shapes.

    The kernels' own rules (megatron.core.fused_kernels.training_ops) are checked on shape-only (meta)
    tensors of one TP rank's activations: layer norm on [s, b, h], bias-dropout-add on [s, b, h]
    (--no-bias-dropout-fusion skips it), bias-GeLU on [s, b, ffn / tp] (not with a GLU or
    --no-bias-gelu-fusion), the scale-mask-softmax on [b, heads / tp, s, s] when attention
    materializes the scores; plus whether fused kernels are enabled and triton is installed.
    """
    from megatron.core.fused_kernels import selection, training_ops

    s, b, h = model.seq_length, micro_batch_size, model.hidden_size

    def meta(*shape):
        return torch.empty(shape, dtype=model.params_dtype, device="meta")

    problems = []
    if not selection.fused_kernels_enabled():
        problems.append(f"fused kernels are disabled ({selection.ENV_VAR})")
    if importlib.util.find_spec("triton") is None:
        problems.append("triton is not installed")
    checks = [("layer norm", training_ops.layer_norm_constraint_violation(meta(s, b, h), meta(h), meta(h)))]
    if model.bias_dropout_fusion:
        checks.append(("bias-dropout-add", training_ops.bias_dropout_add_constraint_violation(
            meta(s, b, h), meta(h), meta(s, b, h), model.hidden_dropout)))
    if model.bias_gelu_fusion and model.glu_activation is None:
        ffn = model.ffn_hidden_size // tensor_model_parallel_size
        checks.append(("bias-GeLU", training_ops.bias_gelu_constraint_violation(meta(ffn), meta(s, b, ffn))))
    if model.attention_impl == "materialized" and model.masked_softmax_fusion:
        heads = model.num_attention_heads // tensor_model_parallel_size
        checks.append(("scale-mask-softmax", training_ops.softmax_constraint_violation(meta(b, heads, s, s), None)))
    return problems + [f"{name}: {why}" for name, why in checks if why]


def check_fused_kernel_constraints(model: GPTModelConfig, tensor_model_parallel_size: int,
                                   micro_batch_size: int, cuda_available: bool | None = None) -> None:
    """--abort-on-unmet-fused-kernel-constraints: raise FusedKernelConstraintError on GPU when a kernel
    would fall back. On CPU every op runs its reference by design, which is not an unmet constraint."""
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        print_rank_0("> --abort-on-unmet-fused-kernel-constraints: no CUDA device, the CPU runs the reference "
                     "ops (fused kernels are GPU-only); nothing to check")
        return
    problems = fused_kernel_violations(model, tensor_model_parallel_size, micro_batch_size)
    if problems:
        raise FusedKernelConstraintError("--abort-on-unmet-fused-kernel-constraints: these fused kernels would fall "
                                         "back to their reference: " + "; ".join(problems))


def initialize_megatron(parallel: "ProcessLayout", logging_config: "LoggingConfig", seed: int) -> ParallelGroups:
    """Process group, model-parallel groups, log levels and seeds; returns this rank's groups."""
    groups = initialize_distributed(parallel)
    apply_log_levels(logging_config, parallel.rank)
    set_random_seeds(seed, groups)
    return groups
