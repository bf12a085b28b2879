"""A run saved under one layout, converted by tools/convert_checkpoint/ds_to_universal.py and resumed
with --universal-checkpoint under another, continues the uninterrupted run: the losses of the four
iterations after the save equal the source run's (fp32: 1e-5 relative, the tolerance of
test_layout_equivalence.py, which explains it; bf16: 2e-3), with the same learning rates and
consumed samples. Losses after a resume depend on the weights, the Adam moments and step, the LR
schedule and the data position, so this checks that the optimizer state moved, not only that the
run started.

Set-up: test_layout_equivalence's flags (fp32, dropout 0, weight decay 1.0, clipping that triggers),
4 layers, 4 heads, hidden 64, sequence 32, global batch 8, 6 iterations, a save at iteration 2: the
sizes of tests/training/test_3d_parallel_cpu.py, whose saving TP=2 x PP=2 x DP=2 run at ZeRO-1 is
the 2_2_2 source here (a session fixture, tests/training/parallel_3d_runs.py). Layouts are
TP_PP_DP; the source runs once per source layout (it is the uninterrupted reference), each target
resumes from its own copy of the conversion. The Llama-class model (RMSNorm, 4 heads over 2 key/value
groups, SwiGLU, rotary base 500000, untied output layer, no biases) converts from its TP=2 x PP=2
run with sequence parallelism (parallel_3d_runs.llama_saving_run, 2 layers, global batch 4, saved at
iteration 2 of 4) and resumes at TP=1 x PP=1 x DP=2: the grouped QKV rows, SwiGLU's halves and the
untied head's vocabulary rows are joined, the final norm averaged, and its iterations 3-4 follow.
"""
import argparse
import os
import shutil

import pytest
import torch

from megatron.core.checkpoint.names import as_pipeline_name
from megatron.core.checkpoint.reader import open_checkpoint
from megatron.core.checkpoint.universal_writer import write_universal_zero
from megatron.training.log_reader import iteration_records
from tests.training.e2e_utils import read_scalars, run_pretrain
from tests.training.parallel_3d_runs import (GLOBAL_BATCH, LLAMA_NUM_LAYERS, LLAMA_SAVE_ITERATION, LLAMA_TRAIN_ITERS,
                                             NUM_LAYERS, SAVE_ITERATION, SEQ_LENGTH, TRAIN_ITERS, llama_flags)
from tests.training.test_layout_equivalence import common_flags, series
from tools.convert_checkpoint import ds_to_universal
from tools.convert_checkpoint.ds_to_universal import write_model_states

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

RESUMED = list(range(SAVE_ITERATION + 1, TRAIN_ITERS + 1))
LOSS_TAG, LR_TAG = "lm-loss-training/lm loss", "learning-rate/learning-rate"
BF16 = ["--bf16"]
# (layout, ZeRO stage, precision) of test_3d_parallel_cpu's saving run, whose checkpoint is converted as it is
SHARED_SOURCE = ("2_2_2", 1, ())
# (source layout, target layout, ZeRO stage of the source, of the target, precision flags)
PAIRS = [
    ("1_1_1", "2_2_2", 1, 1, []),
    ("2_2_2", "1_1_1", 1, 1, []),
    ("2_1_2", "1_2_2", 1, 1, []),
    ("1_2_2", "4_1_1", 1, 1, []),
    ("1_1_4", "1_1_2", 1, 1, []),
    ("1_1_1", "1_1_2", 1, 2, []),
    ("1_1_2", "1_1_1", 2, 1, []),
    ("2_1_1", "1_1_2", 1, 0, []),  # fp32 at ZeRO stage 0 loads the universal checkpoint at stage 1
    ("2_2_1", "1_1_2", 0, 1, []),  # from fp32 at ZeRO stage 0: the optimizer state in the model-states files
    ("1_1_1", "2_1_1", 1, 1, BF16),
]


def layout_flags(layout: str, zero_stage: int) -> tuple[int, list[str]]:
    """(processes, flags) of a TP_PP_DP layout."""
    tp, pp, dp = (int(size) for size in layout.split("_"))
    return tp * pp * dp, ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                          "--zero-stage", str(zero_stage)]


def train(data, layout: str, zero_stage: int, precision: list[str], tensorboard: str, extra: list[str]) -> dict:
    processes, flags = layout_flags(layout, zero_stage)
    flags = common_flags(data, seq_length=SEQ_LENGTH, num_layers=NUM_LAYERS, global_batch=GLOBAL_BATCH,
                         train_iters=TRAIN_ITERS) + flags + precision + extra + ["--tensorboard-dir", tensorboard]
    result = run_pretrain(flags, nproc=processes, timeout=600)
    result.assert_ok()
    return {"scalars": read_scalars(tensorboard), "output": result.output}


@pytest.fixture(scope="module")
def sources(e2e_data, tmp_path_factory, request):
    """(layout, ZeRO stage, precision) -> {"scalars", "output", "save"} of each source run, run once."""
    found = {}

    def source(layout, zero_stage, precision):
        key = (layout, zero_stage, tuple(precision))
        if key == SHARED_SOURCE:  # asked for here, so that a selection without that source does not launch it
            shared = request.getfixturevalue("saving_layout_run")
            return {"scalars": shared["scalars"], "output": shared["output"], "save": str(shared["save"])}
        if key not in found:
            directory = tmp_path_factory.mktemp(f"source_{layout}_z{zero_stage}")
            save = str(directory / "checkpoints")
            found[key] = train(e2e_data, layout, zero_stage, precision, str(directory / "tb"),
                               ["--save", save, "--save-interval", str(SAVE_ITERATION)])
            found[key]["save"] = save
        return found[key]

    return source


def convert(save: str, destination: str, capsys) -> str:
    """ds_to_universal.py's main on the source's global_step2, in a fresh --load directory; returns it.
    In this process: test_merge_mp_partitions.py runs the script as a command."""
    load = os.path.join(destination, "load")
    os.makedirs(load)
    status = ds_to_universal.main(["--input_folder", os.path.join(save, f"global_step{SAVE_ITERATION}"),
                                   "--output_folder", os.path.join(load, f"global_step{SAVE_ITERATION}_universal"),
                                   "--num_extract_workers", "1", "--num_merge_workers", "1"])
    assert status == 0 and "universal checkpoint of iteration 2" in capsys.readouterr().out
    return load


def counters(output: str, iterations: list[int]) -> list[tuple[str, str]]:
    """(consumed samples, consumed tokens) as logged at ``iterations``."""
    records = {record.iteration: record.fields for record in iteration_records(output)}
    return [(records[i]["consumed samples"], records[i]["consumed tokens"]) for i in iterations]


@pytest.mark.parametrize("source_layout, target_layout, source_zero, target_zero, precision", PAIRS,
                         ids=[f"{s}_z{a}-to-{t}_z{b}{'-bf16' if p else ''}" for s, t, a, b, p in PAIRS])
def test_universal_resume_continues_the_source_run(sources, e2e_data, tmp_path, capsys, source_layout,
                                                   target_layout, source_zero, target_zero, precision):
    source = sources(source_layout, source_zero, precision)
    load = convert(source["save"], str(tmp_path), capsys)
    resumed = train(e2e_data, target_layout, target_zero, precision, str(tmp_path / "tb"),
                    ["--load", load, "--universal-checkpoint"])
    assert f"successfully loaded checkpoint from {load} at iteration {SAVE_ITERATION}" in resumed["output"]
    expected, found = source["scalars"], resumed["scalars"]
    rtol = 2e-3 if precision else 1e-5
    expected_losses = series(expected, LOSS_TAG, range(1, TRAIN_ITERS + 1))[SAVE_ITERATION:]
    assert series(found, LOSS_TAG, RESUMED) == pytest.approx(expected_losses, rel=rtol)
    assert series(found, LR_TAG, RESUMED) == series(expected, LR_TAG, range(1, TRAIN_ITERS + 1))[SAVE_ITERATION:]
    assert counters(resumed["output"], RESUMED) == counters(source["output"], RESUMED)
    shutil.rmtree(load)


def deepspeed_reference(tag_directory: str, output: str, num_layers: int = NUM_LAYERS) -> str:
    """DeepSpeed's own conversion of ``tag_directory`` (its model-states files patched to keep the padded
    vocabulary, as the tool records), with parameter folders under pipeline names; returns its zero/."""
    from deepspeed.checkpoint import ds_to_universal as deepspeed_conversion

    source = os.path.join(output, "input")
    os.makedirs(source)
    checkpoint = open_checkpoint(tag_directory)
    for name in os.listdir(tag_directory):
        if not name.startswith("mp_rank_"):
            os.symlink(os.path.join(tag_directory, name), os.path.join(source, name))
    write_model_states(checkpoint, source)
    converted = os.path.join(output, "deepspeed")
    deepspeed_conversion.main(argparse.Namespace(input_folder=source, output_folder=converted, num_extract_workers=1,
                                                 num_merge_workers=1, keep_temp_folder=False, strict=True,
                                                 inject_missing_state=False))
    zero = os.path.join(converted, "zero")
    for name in os.listdir(zero):
        if os.path.isdir(os.path.join(zero, name)):
            os.rename(os.path.join(zero, name), os.path.join(zero, as_pipeline_name(name, num_layers)))
    return zero


@pytest.mark.parametrize("layout, zero_stage", [("2_2_2", 1), ("1_1_2", 2), ("llama", 1)])
def test_our_conversion_writes_what_deepspeeds_writes(sources, request, tmp_path, layout, zero_stage):
    """The streaming conversion gives DeepSpeed's files, tensor for tensor (pipeline names, padded rows kept);
    DeepSpeed joins each TP slice by the patterns our model-states files record."""
    if layout == "llama":
        tag_directory = os.path.join(str(request.getfixturevalue("llama_saving_run")["save"]),
                                     f"global_step{LLAMA_SAVE_ITERATION}")
    else:
        tag_directory = os.path.join(sources(layout, zero_stage, [])["save"], f"global_step{SAVE_ITERATION}")
    expected = deepspeed_reference(tag_directory, str(tmp_path), LLAMA_NUM_LAYERS if layout == "llama" else NUM_LAYERS)
    ours = str(tmp_path / "ours")
    write_universal_zero(open_checkpoint(tag_directory, read_optimizer=True), ours, workers=2)
    found = os.path.join(ours, "zero")
    assert sorted(os.listdir(found)) == sorted(os.listdir(expected))
    for name in os.listdir(expected):
        if name == "optimizer_state.pt":
            common = [torch.load(os.path.join(d, name), weights_only=False) for d in (expected, found)]
            assert common[0]["param_groups"] == common[1]["param_groups"]
            continue
        assert sorted(os.listdir(os.path.join(found, name))) == sorted(os.listdir(os.path.join(expected, name)))
        for state in os.listdir(os.path.join(expected, name)):
            theirs, mine = (torch.load(os.path.join(d, name, state), weights_only=False) for d in (expected, found))
            if state == "step.pt":
                assert mine == theirs
                continue
            assert set(mine) == set(theirs) and torch.equal(mine.pop("param"), theirs.pop("param")), (name, state)
            assert mine == theirs, (name, state)


def test_llama_universal_resume_continues_the_source_run(llama_saving_run, e2e_data, tmp_path, capsys):
    source_save = str(llama_saving_run["save"])
    load = os.path.join(str(tmp_path), "load")
    os.makedirs(load)
    assert ds_to_universal.main(["--input_folder", os.path.join(source_save, f"global_step{LLAMA_SAVE_ITERATION}"),
                                 "--output_folder", os.path.join(load, f"global_step{LLAMA_SAVE_ITERATION}_universal"),
                                 "--num_extract_workers", "1", "--num_merge_workers", "1"]) == 0
    assert "universal checkpoint of iteration 2" in capsys.readouterr().out
    head = os.path.join(load, f"global_step{LLAMA_SAVE_ITERATION}_universal", "zero", f"{LLAMA_NUM_LAYERS + 5}.weight")
    saved = torch.load(os.path.join(head, "fp32.pt"), weights_only=False)
    assert saved["vocab_tensor"] and saved["cat_dim"] == 0 and tuple(saved["param"].shape) == (1152, 64)
    tensorboard = str(tmp_path / "tb")
    processes, flags = layout_flags("1_1_2", 1)
    result = run_pretrain(llama_flags(e2e_data) + flags + ["--load", load, "--universal-checkpoint",
                                                           "--tensorboard-dir", tensorboard], nproc=processes,
                          timeout=600)
    result.assert_ok()
    resumed = list(range(LLAMA_SAVE_ITERATION + 1, LLAMA_TRAIN_ITERS + 1))
    found = read_scalars(tensorboard)
    assert series(found, LOSS_TAG, resumed) == pytest.approx(llama_saving_run["loss"][LLAMA_SAVE_ITERATION:], rel=1e-5)
    assert series(found, LR_TAG, resumed) == llama_saving_run["lr"][LLAMA_SAVE_ITERATION:]
    assert counters(result.output, resumed) == counters(llama_saving_run["output"], resumed)
