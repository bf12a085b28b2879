"""The FP8 flags: what they configure (GPTModelConfig.fp8, the layers kept out of FP8) and the one-line
refusals where FP8 cannot run, all before any process group."""
import dataclasses

import pytest
import torch

from megatron.core.checkpoint.client_state import plain_value
from megatron.core.checkpoint.sharding import saved_model_config
from megatron.core.tensor_parallel.fp8 import Fp8Config
from megatron.training.arguments import ArgumentError
from megatron.training.config import build_config
from tests.training.test_arguments import parse, world

EMULATED = ["--fp8-format", "hybrid", "--fp8-cpu-emulation"]


def model_config(extra, env=None):
    return build_config(parse(extra, env=env), 50257).model


def refusal(extra, env=None, cuda=False) -> str:
    with pytest.raises(ArgumentError) as info:
        build_config(parse(extra, env=env, cuda=cuda), 50257)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_no_fp8_by_default():
    config = model_config([])
    assert config.fp8 is None and all(config.fp8_for_layer(n) is None for n in range(1, config.num_layers + 1))


def test_fp8_flags_make_the_config_megatron_lm_defaults_and_given_values():
    assert model_config(EMULATED).fp8 == Fp8Config("hybrid", "delayed", 1, "most_recent", 0, emulate=True)
    given = model_config(["--fp8-format", "e4m3", "--fp8-cpu-emulation", "--fp8-recipe", "delayed",
                          "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max", "--fp8-margin", "2"])
    assert given.fp8 == Fp8Config("e4m3", "delayed", 16, "max", 2, emulate=True)


def test_first_last_layers_keep_the_model_precision():
    layers = ["--num-layers", "6"]
    config = model_config(EMULATED + layers + ["--first-last-layers-bf16"])
    assert [config.fp8_for_layer(n) is not None for n in range(1, 7)] == [False, True, True, True, True, False]
    config = model_config(EMULATED + layers + ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "2",
                                               "--num-layers-at-end-in-bf16", "0"])
    assert [config.fp8_for_layer(n) is not None for n in range(1, 7)] == [False, False, True, True, True, True]
    assert all(model_config(EMULATED + layers).fp8_for_layer(n) is not None for n in range(1, 7))


@pytest.mark.parametrize("extra, words", [
    (["--fp8-format", "hybrid"], ["CUDA GPU", "9.0", "--fp8-cpu-emulation"]),
    (["--fp8-recipe", "rowwise"], ["--fp8-recipe", "add --fp8-format"]),
    (["--first-last-layers-bf16"], ["--first-last-layers-bf16", "--fp8-format"]),
    (["--fp8-cpu-emulation"], ["--fp8-cpu-emulation", "--fp8-format"]),
    (EMULATED + ["--fp8-amax-history-len", "0"], ["--fp8-amax-history-len 0"]),
    (EMULATED + ["--fp8-margin", "-1"], ["--fp8-margin -1"]),
    (EMULATED + ["--num-layers", "2", "--first-last-layers-bf16"], ["--num-layers-at-start-in-bf16", "none"]),
])
def test_refusals_name_the_flag(extra, words):
    message = refusal(extra)
    assert all(word in message for word in words), message


def test_accepted_with_tp_comm_overlap():
    config = model_config(EMULATED + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                      "--tp-comm-overlap"], env=world(2))
    assert config.fp8 is not None and config.tp_comm_overlap


def test_refused_with_fp16():
    message = refusal(EMULATED + ["--fp16"], cuda=True)
    assert "--fp16" in message and "--bf16" in message


def test_refused_on_a_gpu_before_hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA A100")
    message = refusal(["--fp8-format", "hybrid", "--bf16"], cuda=True)
    assert "A100 has 8.0" in message and "9.0" in message
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))
    assert build_config(parse(["--fp8-format", "hybrid", "--bf16"], cuda=True), 50257).model.fp8.emulate is False


def test_refused_with_a_torch_lacking_scaled_mm(monkeypatch):
    monkeypatch.delattr(torch, "_scaled_mm")
    assert "torch._scaled_mm" in refusal(["--fp8-format", "hybrid"], cuda=True)


def test_the_parsed_fp8_config_survives_a_checkpoints_plain_args():
    """A checkpoint keeps args.model as plain values: its fp8 dict becomes the Fp8Config again."""
    config = model_config(EMULATED + ["--num-layers", "4", "--first-last-layers-bf16"])
    assert saved_model_config(plain_value(config)) == dataclasses.replace(config)
