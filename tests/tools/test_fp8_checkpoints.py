"""The checkpoint tools on a checkpoint trained in FP8 (delayed scaling, TP = 2 with sequence
parallelism, the CPU emulation): merge, reshape, Megatron-LM export, universal conversion and the
transformers export each print one notice, drop the FP8 state (amax histories, scales) and carry the
weights exactly; a run in FP8 resumes from the reshaped weights with fresh scales and a notice, and
the inference model built from an FP8 checkpoint has no FP8 layers.

The source: test_layout_equivalence's flags (fp32), 2 layers, 2 iterations at TP = 2, saved at 2.
"""
import glob
import os

import pytest
import torch

from megatron.core.checkpoint.model_loading import full_model_state, load_gpt_model
from megatron.core.checkpoint.reader import open_checkpoint
from megatron.core.tensor_parallel.fp8_linear import Fp8Gemms
from tests.training.e2e_utils import run_pretrain
from tests.training.test_layout_equivalence import common_flags
from tools import merge_mp_partitions
from tools.convert_checkpoint import deepspeed_to_deepspeed, deepspeed_to_megatron, deepspeed_to_transformers, \
    ds_to_universal

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SAVE_ITERATION = 2
FP8 = ["--fp8-format", "hybrid", "--fp8-cpu-emulation"]
NOTICE = "was trained in FP8: its delayed-scaling state (amax histories, scales) is dropped, the weights are carried"


def flags(data, *extra) -> list[str]:
    return common_flags(data, train_iters=SAVE_ITERATION) + FP8 + list(extra)


@pytest.fixture(scope="module")
def source(e2e_data, tmp_path_factory) -> str:
    save = str(tmp_path_factory.mktemp("fp8_source") / "checkpoints")
    run_pretrain(flags(e2e_data, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--save", save,
                       "--save-interval", str(SAVE_ITERATION)), nproc=2, timeout=600).assert_ok()
    return os.path.join(save, f"global_step{SAVE_ITERATION}")


def fp8_keys(directory: str) -> list[str]:
    keys = []
    for path in glob.glob(os.path.join(directory, "**", "*.pt"), recursive=True):
        state = torch.load(path, map_location="cpu", weights_only=False)
        keys += [key for key in (state.get("module") or state) if "fp8_gemms" in str(key)] \
            if isinstance(state, dict) else []
    return keys


def test_reshaped_weights_are_carried_without_fp8_state(e2e_data, source, tmp_path, capsys):
    assert fp8_keys(source)  # the source holds the state the tools drop
    reshaped = str(tmp_path / "tp1")
    assert deepspeed_to_deepspeed.main(["--input_folder", source, "--output_folder", reshaped,
                                        "--target_tp", "1"]) == 0
    assert NOTICE in capsys.readouterr().err
    output = open_checkpoint(os.path.join(reshaped, f"global_step{SAVE_ITERATION}"))
    assert not fp8_keys(output.directory) and output.model["fp8"] is None
    expected, found = full_model_state(open_checkpoint(source)), full_model_state(output)
    assert expected.keys() == found.keys()
    assert all(torch.equal(expected[name][:found[name].shape[0]], found[name]) for name in expected)

    resumed = run_pretrain(flags(e2e_data, "--train-iters", "3", "--load", reshaped, "--no-load-optim",
                                 "--no-load-rng"), timeout=600)
    resumed.assert_ok()
    assert "notice: the checkpoint has no FP8 delayed-scaling state" in resumed.output
    assert [line.iteration for line in resumed.log_lines()] == [3]


@pytest.mark.parametrize("tool, arguments", [
    (merge_mp_partitions, lambda source, out: ["--model-type", "GPT", "--tensor-model-parallel-size", "2", "--load",
                                               source, "--save", out, "--num-layers", "2"]),
    (deepspeed_to_megatron, lambda source, out: ["--input_folder", source, "--output_folder", out]),
    (ds_to_universal, lambda source, out: ["--input_folder", source, "--output_folder", out]),
    (deepspeed_to_transformers, lambda source, out: ["--input_folder", source, "--output_folder", out]),
])
def test_tools_drop_the_fp8_state_with_one_notice(source, tmp_path, capsys, tool, arguments):
    output = str(tmp_path / "out")
    assert tool.main(arguments(source, output)) == 0
    errors = capsys.readouterr().err
    assert errors.count(NOTICE) == 1
    assert not fp8_keys(output) and not glob.glob(os.path.join(output, "**", "*fp8*"), recursive=True)


def test_inference_model_of_an_fp8_checkpoint_runs_without_fp8(source):
    model = load_gpt_model(open_checkpoint(source))
    assert model.config.fp8 is None and not any(isinstance(m, Fp8Gemms) for m in model.modules())
