"""megatron.core.dtypes: every accepted spelling against torch's own dtype objects."""
import pytest
import torch

from megatron.core.dtypes import DTYPES, DtypeNameError, canonical_dtype_name, dtype_name, torch_dtype

SPELLINGS = {
    torch.float32: ["fp32", "FP32", "float32", "float", " Float "],
    torch.float16: ["fp16", "float16", "half", "HALF"],
    torch.bfloat16: ["bf16", "bfloat16", "BFloat16"],
}


@pytest.mark.parametrize("dtype", list(SPELLINGS))
def test_every_spelling_names_its_dtype(dtype):
    for spelling in SPELLINGS[dtype]:
        assert torch_dtype(spelling) is dtype
        assert DTYPES[canonical_dtype_name(spelling)] is dtype


def test_canonical_names_round_trip():
    assert {name: dtype_name(torch_dtype(name)) for name in ("fp32", "fp16", "bf16")} == \
        {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}


@pytest.mark.parametrize("name", ["fp8", "int8", "", "None", "float64", None])
def test_unknown_names(name):
    assert canonical_dtype_name(name) is None
    with pytest.raises(DtypeNameError, match=r"--dtype: unknown dtype name"):
        torch_dtype(name, where="--dtype")


def test_dtype_without_a_name():
    with pytest.raises(DtypeNameError, match="float64"):
        dtype_name(torch.float64)
