"""The command line of pretrain_gpt.py: Megatron-DeepSpeed's flags, validated before anything starts.

    parsed = parse_args()                         # flags + launcher environment -> ParsedArguments
    config = build_config(parsed, vocab_size)     # megatron/training/config.py: frozen dataclasses

Modules:
    argument_groups.py      the accepted flags (Megatron-DeepSpeed's names, defaults, --help groups)
    argument_rejections.py  recognised flags that are refused, with the table of reasons
    argument_types.py       ArgumentError, number notations ("6_000_000", "10e6"), booleans
    argument_ds_config.py   the ds_config: loaded, compared with the given flags, completed
    validation.py           cross-flag checks; the derived values (DerivedValues)
    launch_env.py           rank / world size / rendezvous from deepspeed, torchrun, SLURM, env

``ParsedArguments`` keeps three things apart: the flags exactly as argparse read them (a read-only
Namespace), the dests given on the command line, and what validation derived (launch layout,
data-parallel size, backend, sequence length, the final ds_config and the notices). Notices print
once, on rank 0.
"""
import argparse
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from megatron.training.argument_groups import ARGUMENT_GROUPS, DefaultsHelpFormatter
from megatron.training.argument_rejections import add_rejected_flags
from megatron.training.argument_types import ArgumentError, ErrorRaisingParser
from megatron.training.engine.ds_config import add_deepspeed_flags
from megatron.training.engine.replacements import check_deepspeed
from megatron.training.launch_env import rank_in_environment, read_launch_env
from megatron.training.log_files import write_log_file
from megatron.training.validation import DerivedValues, validate_args

__all__ = ["ArgumentError", "ParsedArguments", "build_parser", "explicit_dests", "format_args", "parse_args",
           "parse_args_or_exit", "write_args_listing"]

NOTICE_PREFIX = "notice: "


class ReadOnlyNamespace(argparse.Namespace):
    """The parsed flags, frozen: a derived value must live in DerivedValues, never on the flags."""

    def __init__(self, namespace: argparse.Namespace):
        for name, value in vars(namespace).items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError(f"the parsed flags are read-only (tried to set {name!r})")

    def __delattr__(self, name):
        raise AttributeError(f"the parsed flags are read-only (tried to delete {name!r})")


@dataclass(frozen=True)
class ParsedArguments:
    """The command line of this process.

    Attributes:
        flags: every flag as argparse read it (defaults included), read-only.
        explicit: the dests given on the command line.
        derived: what validation derived (validation.DerivedValues).
    """

    flags: argparse.Namespace
    explicit: frozenset[str]
    derived: DerivedValues

    def listing(self) -> dict[str, object]:
        """Every flag with its effective value, plus the derived values and the final ds_config
        (``deepspeed_config_dict``), for the arguments listing."""
        derived, launch = self.derived, self.derived.launch
        effective = {"world_size": launch.world_size, "rank": launch.rank, "local_rank": launch.local_rank,
                     "master_addr": launch.master_addr, "master_port": launch.master_port,
                     "launcher": launch.source, "data_parallel_size": derived.data_parallel_size,
                     "distributed_backend": derived.distributed_backend, "seq_length": derived.seq_length,
                     "global_batch_size": derived.global_batch_size, "fp16": derived.fp16, "bf16": derived.bf16,
                     "params_dtype": derived.params_dtype, "clip_grad": derived.clip_grad,
                     "zero_stage": derived.zero_stage, "deepspeed_config_dict": derived.ds_config}
        return {**vars(self.flags), **effective}


def build_parser() -> argparse.ArgumentParser:
    """Every flag: Megatron-DeepSpeed's groups, the refused flags, then DeepSpeed's (--deepspeed, ...)."""
    parser = ErrorRaisingParser(description="Pretrain a GPT model (Megatron-DeepSpeed flags)",
                                allow_abbrev=False, formatter_class=DefaultsHelpFormatter)
    for add_group in ARGUMENT_GROUPS:
        add_group(parser)
    add_rejected_flags(parser)
    add_deepspeed_flags(parser)
    return parser


def explicit_dests(argv: Sequence[str]) -> frozenset[str]:
    """Dests of the flags present in ``argv``: the same parser with every default suppressed."""
    probe = build_parser()
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    return frozenset(vars(probe.parse_args(argv)))


def parse_args(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None, *,
               cuda_available: bool | None = None) -> ParsedArguments:
    """Parse and validate the command line of this process; see the module docstring.

    ``argv`` defaults to sys.argv[1:], ``env`` to os.environ (the launcher's variables),
    ``cuda_available`` to torch.cuda.is_available() (which creates no CUDA context).
    Raises ArgumentError naming the flags and the fix.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    env = os.environ if env is None else env
    cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
    flags = ReadOnlyNamespace(build_parser().parse_args(argv))
    engine_warnings = check_deepspeed(flags.allow_untested_deepspeed)
    explicit = explicit_dests(argv)
    launch = read_launch_env(env, flags.local_rank)
    if launch.rank == 0:
        for warning in engine_warnings:
            print(warning, flush=True)
    parsed = ParsedArguments(flags, explicit, validate_args(flags, explicit, launch, cuda_available))
    if launch.rank == 0:
        for notice in parsed.derived.notices:
            print(NOTICE_PREFIX + notice, flush=True)
    return parsed


# How long another rank waits for rank 0 to report an error that every rank met, before reporting it too.
REPORT_GRACE_SECONDS = 10.0


def report_error_and_exit(error: Exception, status: int, env: Mapping[str, str] | None = None, *,
                          every_rank: bool = False, grace_seconds: float = REPORT_GRACE_SECONDS) -> None:
    """``prog: error: ...`` on stderr, then exit ``status``. Before the process group exists every rank
    meets the same error, so rank 0 reports it; ``every_rank`` for errors one rank may meet alone.

    The other ranks wait ``grace_seconds`` first: the launchers (torchrun, deepspeed) stop every rank
    as soon as one exits with an error, so a rank that exited at once could take rank 0 down before
    it printed (a loaded machine delays rank 0). If no launcher stops them, they report it too."""
    if not every_rank and rank_in_environment(os.environ if env is None else env) != 0:
        time.sleep(grace_seconds)
    print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr, flush=True)
    sys.exit(status)


def parse_args_or_exit(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> ParsedArguments:
    """parse_args for entry points: an ArgumentError becomes "prog: error: ..." and exit status 2."""
    try:
        return parse_args(argv, env)
    except ArgumentError as exc:
        report_error_and_exit(exc, 2, env)


def format_args(parsed: ParsedArguments) -> str:
    """Megatron-DeepSpeed's listing of all arguments, one "name ..... value" line each, sorted by name."""
    entries = parsed.listing()
    lines = ["------------------------ arguments ------------------------"]
    for name in sorted(entries):
        value = entries[name]
        value = sorted(value) if isinstance(value, (set, frozenset)) else value  # stable across runs
        lines.append(f"  {name} {'.' * max(48 - len(name), 1)} {value}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines) + "\n"


def write_args_listing(parsed: ParsedArguments, directory: str) -> str:
    """Write format_args to ``directory``/args_<YYYYmmdd-HHMMSS>.txt (--log-path); return the path."""
    return write_log_file(directory, "args", format_args(parsed))


def report_arguments(parsed: ParsedArguments) -> None:
    """Rank 0: with --log-path the listing goes to a file and the console gets one line; without it,
    the console gets the whole listing, as Megatron-DeepSpeed prints it."""
    if parsed.derived.launch.rank != 0:
        return
    directory = parsed.flags.log_path
    if not directory:
        print(format_args(parsed), flush=True)
        return
    path = write_args_listing(parsed, directory)
    print(f"> arguments: {len(parsed.explicit)} given on the command line, {len(parsed.listing())} in all; "
          f"listing in {path}", flush=True)
