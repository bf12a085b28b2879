"""Floating-point dtypes by name: the one table that flags, ds_configs and tools read names through.

Canonical names are Megatron-DeepSpeed's flag spelling, which is also DeepSpeed's ds_config keys:
"fp32", "fp16", "bf16". Where a name is read, torch's spellings ("float32", "float16", "bfloat16")
and C's ("float", "half") are accepted as well, in any case.
"""
import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ALIASES: dict[str, str] = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16",
                           "bfloat16": "bf16"}


class DtypeNameError(ValueError):
    """A dtype name that is not in the table."""


def canonical_dtype_name(name: object) -> str | None:
    """"fp32", "fp16" or "bf16" for any accepted spelling of ``name`` (str() of it, any case); None otherwise."""
    spelled = str(name).strip().lower()
    return spelled if spelled in DTYPES else ALIASES.get(spelled)


def torch_dtype(name: str, where: str = "dtype") -> torch.dtype:
    """The torch dtype named ``name``; DtypeNameError naming ``where`` (a flag, a file) when unknown."""
    canonical = canonical_dtype_name(name)
    if canonical is None:
        accepted = ", ".join(sorted(DTYPES) + sorted(ALIASES))
        raise DtypeNameError(f"{where}: unknown dtype name {name!r} (accepted: {accepted})")
    return DTYPES[canonical]


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of ``dtype``: "fp32", "fp16" or "bf16"; DtypeNameError for any other dtype."""
    for name, candidate in DTYPES.items():
        if candidate == dtype:
            return name
    raise DtypeNameError(f"{dtype} has no name in the table (known: {sorted(DTYPES)})")
