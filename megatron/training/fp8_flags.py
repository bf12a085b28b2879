"""The FP8 flags: the model's FP8 settings (``fp8_settings``) and where FP8 cannot run (``check_fp8``).

--fp8-format turns FP8 on (megatron/core/tensor_parallel/fp8.py has the formats and recipes). It
runs on a CUDA GPU of compute capability 9.0 or more (Hopper: FP8 tensor cores) through
torch._scaled_mm; on CPU only the tests' --fp8-cpu-emulation runs it (each operand quantized and
dequantized around a plain matmul). ``check_fp8`` refuses the rest with one line before any process
group: FP8 without a usable GPU, and with --fp16 (untested: the tests run on CPU, where fp16 training
is not available).
"""
import torch

from megatron.core.tensor_parallel.fp8 import Fp8Config, Fp8ConfigError
from megatron.training.argument_types import ArgumentError

# the flags that only mean something with --fp8-format
_FP8_OPTION_DESTS = ("fp8_recipe", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_margin",
                     "first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
                     "fp8_cpu_emulation")
MIN_CAPABILITY = (9, 0)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def fp8_config(flags) -> Fp8Config | None:
    """The Fp8Config of --fp8-format and its recipe flags, None without --fp8-format."""
    if flags.fp8_format is None:
        return None
    try:
        return Fp8Config(format=flags.fp8_format, recipe=flags.fp8_recipe,
                         amax_history_len=flags.fp8_amax_history_len,
                         amax_compute_algo=flags.fp8_amax_compute_algo, margin=flags.fp8_margin,
                         emulate=bool(flags.fp8_cpu_emulation))
    except Fp8ConfigError as exc:
        raise ArgumentError(str(exc)) from None


def fp8_settings(flags) -> dict:
    """GPTModelConfig's FP8 fields: ``fp8`` and the layers --first-last-layers-bf16 keeps out of it."""
    fp8 = fp8_config(flags)
    keep = fp8 is not None and flags.first_last_layers_bf16
    return {"fp8": fp8, "num_layers_at_start_in_bf16": flags.num_layers_at_start_in_bf16 if keep else 0,
            "num_layers_at_end_in_bf16": flags.num_layers_at_end_in_bf16 if keep else 0}


def check_fp8(args, explicit, cuda_available: bool, fp16: bool) -> None:
    """Raise ArgumentError (one line naming the flag) where FP8 cannot run (module docstring)."""
    if args.fp8_format is None:
        given = [_flag(dest) for dest in _FP8_OPTION_DESTS if dest in explicit]
        if given:
            raise ArgumentError(f"{given[0]} sets up FP8 training, which --fp8-format turns on: add "
                                "--fp8-format e4m3 or hybrid, or drop it")
        return
    fp8_config(args)
    if fp16:
        raise ArgumentError("--fp8-format runs with --bf16 (or fp32) parameters, not --fp16 (fp16 with FP8 is not "
                            "tested); use --bf16")
    if args.fp8_cpu_emulation:
        return
    _check_fp8_gpu(cuda_available)


def _check_fp8_gpu(cuda_available: bool) -> None:
    if not cuda_available:
        raise ArgumentError("--fp8-format needs a CUDA GPU of compute capability >= 9.0 (Hopper); this machine has "
                            "none (--fp8-cpu-emulation runs the tests' emulation on CPU)")
    if not hasattr(torch, "_scaled_mm"):
        raise ArgumentError(f"--fp8-format needs torch._scaled_mm, which torch {torch.__version__} lacks: install "
                            "torch >= 2.4")
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        raise ArgumentError(f"--fp8-format needs a GPU of compute capability >= 9.0 (Hopper); "
                            f"{torch.cuda.get_device_name()} has {capability[0]}.{capability[1]}: "
                            "train with --bf16")
