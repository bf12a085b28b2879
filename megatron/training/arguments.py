"""The command line of pretrain_gpt.py: Megatron-DeepSpeed's flags, validated before anything starts.

    args = parse_args()                         # flags + launcher environment -> checked Namespace
    config = build_config(args, vocab_size)     # megatron/training/config.py: frozen dataclasses

Modules:
    argument_groups.py      the accepted flags (seed names, defaults, --help groups)
    argument_rejections.py  recognised flags that are refused, with the table of reasons
    argument_types.py       ArgumentError, number notations ("6_000_000", "10e6"), booleans
    argument_ds_config.py   the ds_config: loaded, compared with the given flags, completed
    validation.py           cross-flag checks and derived values
    launch_env.py           rank / world size / rendezvous from deepspeed, torchrun, SLURM, env

After ``parse_args`` the Namespace also holds: ``world_size``, ``rank``, ``local_rank``,
``master_addr``, ``master_port``, ``launcher``, ``data_parallel_size``, ``params_dtype``,
``deepspeed_config_dict`` (the final ds_config), ``explicit_flags`` (dests given on the command
line) and ``notices``. ``global_batch_size``, ``ffn_hidden_size``, ``kv_channels``, ``seq_length``,
``fp16``, ``bf16``, ``clip_grad``, ``zero_stage``, the loss-scale flags and
``distributed_backend`` hold effective values (defaults derived, the ds_config's where it wins).
Notices (flags the ds_config overrides, gloo instead of nccl, ...) print once, on rank 0.
"""
import argparse
import os
import sys
import tempfile
import time

import deepspeed
import torch

from megatron.training.argument_groups import ARGUMENT_GROUPS
from megatron.training.argument_rejections import add_rejected_flags
from megatron.training.argument_types import ArgumentError, ErrorRaisingParser
from megatron.training.launch_env import read_launch_env
from megatron.training.validation import validate_args

__all__ = ["ArgumentError", "build_parser", "explicit_dests", "format_args", "parse_args",
           "parse_args_or_exit", "write_args_listing"]

NOTICE_PREFIX = "notice: "


def build_parser() -> argparse.ArgumentParser:
    """Every flag: the seed's groups, the refused flags, then DeepSpeed's (--deepspeed, --deepspeed_config)."""
    parser = ErrorRaisingParser(description="Pretrain a GPT model (Megatron-DeepSpeed flags)",
                                allow_abbrev=False)
    for add_group in ARGUMENT_GROUPS:
        add_group(parser)
    add_rejected_flags(parser)
    deepspeed.add_config_arguments(parser)
    return parser


def explicit_dests(argv) -> set:
    """Dests of the flags present in ``argv``: the same parser with every default suppressed."""
    probe = build_parser()
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    return set(vars(probe.parse_args(argv)))


def parse_args(argv=None, env=None, *, cuda_available=None) -> argparse.Namespace:
    """Parse and validate the command line of this process; see the module docstring.

    ``argv`` defaults to sys.argv[1:], ``env`` to os.environ (the launcher's variables),
    ``cuda_available`` to torch.cuda.is_available() (which creates no CUDA context).
    Raises ArgumentError naming the flags and the fix.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    env = os.environ if env is None else env
    cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
    args = build_parser().parse_args(argv)
    args.explicit_flags = explicit_dests(argv)
    launch = read_launch_env(env, args.local_rank)
    args.notices = validate_args(args, args.explicit_flags, launch, cuda_available)
    if args.rank == 0:
        for notice in args.notices:
            print(NOTICE_PREFIX + notice, flush=True)
    return args


def parse_args_or_exit(argv=None, env=None) -> argparse.Namespace:
    """parse_args for entry points: an ArgumentError becomes "prog: error: ..." and exit status 2."""
    try:
        return parse_args(argv, env)
    except ArgumentError as exc:
        print(f"{os.path.basename(sys.argv[0])}: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


def format_args(args: argparse.Namespace) -> str:
    """The seed's listing of all arguments, one "name ..... value" line each, sorted by name."""
    lines = ["------------------------ arguments ------------------------"]
    for name in sorted(vars(args)):
        value = getattr(args, name)
        value = sorted(value) if isinstance(value, (set, frozenset)) else value  # stable across runs
        lines.append(f"  {name} {'.' * max(48 - len(name), 1)} {value}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines) + "\n"


def write_args_listing(args: argparse.Namespace, directory: str) -> str:
    """Write format_args(args) to ``directory``/args_<YYYYmmdd-HHMMSS>.txt (--log-path); return the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"args_{time.strftime('%Y%m%d-%H%M%S')}.txt")
    with tempfile.NamedTemporaryFile("w", dir=directory, prefix=".args_", delete=False) as f:
        f.write(format_args(args))
    os.replace(f.name, path)
    return path
