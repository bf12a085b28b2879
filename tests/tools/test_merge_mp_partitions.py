"""Model-only conversions (tools/merge_mp_partitions.py, tools/convert_checkpoint/deepspeed_to_deepspeed.py,
deepspeed_to_megatron.py, ds_to_universal.py's checks): a TP=2 x PP=2 checkpoint merged to TP=1, or
reshaped to TP=4, gives the source run's loss on the same batch; written in Megatron-LM's layout, its
files put back together by the test give the source's tensors; damaged inputs are refused by name
and leave no output.

The source: test_layout_equivalence's flags (fp32, dropout 0), 4 layers, 4 heads, 3 iterations
under TP=2 x PP=2 (4 gloo processes), saved at iteration 2. Iteration 3's loss is computed from the
weights of iteration 2 before any update, so a run resumed from the converted weights with
--no-load-optim must log the same loss: 1e-6 relative (the layouts only reorder fp32 sums, which
moves a loss of ~7 by a few ulps; test_layout_equivalence.py says more), with the same learning
rate, since the LR schedule and the counters are carried.

The Llama-class source (RMSNorm, 4 heads over 2 key/value groups, SwiGLU, rotary base 500000, an
untied output layer, no biases) is parallel_3d_runs.llama_saving_run (TP=2 x PP=2 with sequence
parallelism, saved at iteration 2 of 4): merged to TP=1 and reshaped to TP=1 x PP=2 it gives the
source's iteration-3 loss; its output layer (layer L+5) is split by vocabulary rows and its grouped QKV
by whole groups, so TP=4 (more ranks than its 2 groups) is refused; in Megatron-LM's layout the head
is ``language_model.output_layer``.
"""
import os
import shutil
import sys

import pytest
import torch

from megatron.core.checkpoint.manifest import read_manifest
from megatron.core.checkpoint.model_loading import full_model_state
from megatron.core.checkpoint.reader import open_checkpoint
from tests.conftest import REPO_ROOT
from tests.training.e2e_utils import read_scalars, run_command, run_pretrain
from tests.training.parallel_3d_runs import LLAMA_NUM_LAYERS, LLAMA_SAVE_ITERATION, llama_flags
from tests.training.test_layout_equivalence import common_flags, series
from tools import merge_mp_partitions
from tools.convert_checkpoint import deepspeed_to_deepspeed, deepspeed_to_megatron, ds_to_universal

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

NUM_LAYERS, SEQ_LENGTH, GLOBAL_BATCH, TRAIN_ITERS, SAVE_ITERATION = 4, 32, 8, 3, 2
LOSS_TAG, LR_TAG = "lm-loss-training/lm loss", "learning-rate/learning-rate"
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def train(data, processes: int, flags: list[str], tensorboard: str) -> dict:
    flags = common_flags(data, seq_length=SEQ_LENGTH, num_layers=NUM_LAYERS, global_batch=GLOBAL_BATCH,
                         train_iters=TRAIN_ITERS) + flags + ["--tensorboard-dir", tensorboard]
    result = run_pretrain(flags, nproc=processes, timeout=600)
    result.assert_ok()
    return read_scalars(tensorboard)


@pytest.fixture(scope="module")
def source(e2e_data, tmp_path_factory):
    """(the TP=2 x PP=2 run's global_step2 directory, its TensorBoard scalars)."""
    directory = tmp_path_factory.mktemp("source")
    save = str(directory / "checkpoints")
    scalars = train(e2e_data, 4, TP2_PP2 + ["--zero-stage", "1", "--save", save, "--save-interval",
                                            str(SAVE_ITERATION)], str(directory / "tb"))
    return os.path.join(save, f"global_step{SAVE_ITERATION}"), scalars


def assert_resumes_with_source_loss(data, source, load: str, processes: int, layout: list[str], tensorboard: str):
    _, expected = source
    found = train(data, processes, layout + ["--load", load, "--no-load-optim", "--no-load-rng"], tensorboard)
    assert series(found, LOSS_TAG, [3]) == pytest.approx(series(expected, LOSS_TAG, [1, 2, 3])[2:], rel=1e-6)
    assert series(found, LR_TAG, [3]) == series(expected, LR_TAG, [1, 2, 3])[2:]


def test_merged_to_tp1_gives_the_source_loss(e2e_data, source, tmp_path):
    merged = str(tmp_path / "merged")
    status = merge_mp_partitions.main(["--model-type", "GPT", "--tensor-model-parallel-size", "2", "--load", source[0],
                                       "--save", merged, "--num-layers", str(NUM_LAYERS), "--micro-batch-size", "1"])
    assert status == 0
    assert sorted(name for name in os.listdir(os.path.join(merged, "global_step2")) if name.startswith("layer_")) == [
        f"layer_{layer:02d}-model_00-model_states.pt" for layer in (1, 3, 4, 5, 6, 8)]
    assert read_manifest(os.path.join(merged, "global_step2")) is not None
    assert_resumes_with_source_loss(e2e_data, source, merged, 1, [], str(tmp_path / "tb"))


def test_reshaped_to_tp4_gives_the_source_loss(e2e_data, source, tmp_path):
    reshaped = str(tmp_path / "tp4")
    assert deepspeed_to_deepspeed.main(["--input_folder", source[0], "--output_folder", reshaped,
                                        "--target_tp", "4", "--target_pp", "1"]) == 0
    assert_resumes_with_source_loss(e2e_data, source, reshaped, 4, ["--tensor-model-parallel-size", "4"],
                                    str(tmp_path / "tb"))


def damaged_copy(source_directory: str, tmp_path, damage) -> str:
    """A copy of the source's global_step2 with ``damage(directory)`` applied."""
    copy = str(tmp_path / "damaged" / "global_step2")
    shutil.copytree(source_directory, copy)
    damage(copy)
    return copy


def remove(name):
    return lambda directory: os.remove(os.path.join(directory, name))


def truncate(name):
    def damage(directory):
        path = os.path.join(directory, name)
        os.truncate(path, os.path.getsize(path) // 2)
    return damage


@pytest.mark.parametrize("damage, named", [
    (remove("layer_04-model_01-model_states.pt"), "layer_04-model_01-model_states.pt is missing"),
    (truncate("layer_05-model_00-model_states.pt"), "layer_05-model_00-model_states.pt has"),
    (remove("mp_rank_03_model_states.pt"), "mp_rank_03_model_states.pt is missing"),
    (truncate("zero_pp_rank_0_mp_rank_02_optim_states.pt"), "zero_pp_rank_0_mp_rank_02_optim_states.pt has"),
], ids=["missing-shard", "truncated-layer", "missing-model-states", "truncated-optimizer"])
def test_damaged_inputs_are_named_and_leave_no_output(source, tmp_path, capsys, damage, named):
    damaged = damaged_copy(source[0], tmp_path, damage)
    outputs = {"reshape": str(tmp_path / "reshaped"), "universal": str(tmp_path / "universal")}
    assert deepspeed_to_deepspeed.main(["--input_folder", damaged, "--output_folder", outputs["reshape"],
                                        "--target_tp", "1"]) == 1
    assert ds_to_universal.main(["--input_folder", damaged, "--output_folder", outputs["universal"]]) == 1
    errors = capsys.readouterr().err
    assert errors.count(named) == 2, errors
    assert not any(os.path.exists(path) for path in outputs.values())
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]  # no partial directory left


def test_ds_to_universal_runs_as_a_command_with_extract_workers(source, tmp_path):
    """The script from another directory, with two spawned extraction processes (the tests elsewhere call
    its main in their own process)."""
    output = tmp_path / "load" / "global_step2_universal"
    result = run_command([sys.executable, os.path.join(REPO_ROOT, "tools", "convert_checkpoint", "ds_to_universal.py"),
                          "--input_folder", source[0], "--output_folder", str(output), "--num_extract_workers", "2"],
                         cwd=str(tmp_path), timeout=300)
    result.assert_ok()
    assert f"universal checkpoint of iteration 2 (saved at TP 2, PP 2, DP 1) written to {output}" in result.output
    assert (tmp_path / "load" / "latest_universal").read_text().strip() == "global_step2_universal"
    assert os.path.isdir(output / "zero" / "3.mlp.dense_h_to_4h.weight")


def test_wrong_input_folder_and_unsplittable_layout_are_refused(source, tmp_path, capsys):
    output = str(tmp_path / "out")
    assert deepspeed_to_deepspeed.main(["--input_folder", str(tmp_path), "--output_folder", output]) == 1
    assert deepspeed_to_deepspeed.main(["--input_folder", source[0], "--output_folder", output,
                                        "--target_tp", "3"]) == 1
    assert merge_mp_partitions.main(["--model-type", "GPT", "--tensor-model-parallel-size", "4", "--load", source[0],
                                     "--save", output]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert f"--input_folder {tmp_path} is not a checkpoint" in errors[0]
    assert "--target_tp 3: the model's 4 attention heads" in errors[1]
    assert "--tensor-model-parallel-size 4" in errors[2] and "saved with TP 2" in errors[2]
    assert not os.path.exists(output)


def megatron_lm_tensors(root: str, tp: int, pp: int) -> tuple[dict, list[dict]]:
    """(the full tensors under GPTModel's names, the files) of a Megatron-LM checkpoint directory, put
    together here from the layout alone: column-parallel and vocabulary tensors concatenated on dim 0,
    row-parallel weights on dim 1, the rest taken from rank 0; stage p's layer i is layer p * L/pp + i."""
    files = [[torch.load(os.path.join(root, f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""),
                                      "model_optim_rng.pt"), weights_only=False) for t in range(tp)] for p in range(pp)]
    per_stage = files[0][0]["args"].num_layers // pp
    full = {}

    def joined(name, tensors):
        if name.endswith(("query_key_value.weight", "query_key_value.bias", "dense_h_to_4h.weight",
                          "dense_h_to_4h.bias", "word_embeddings.weight")):
            return torch.cat(tensors, dim=0)
        return torch.cat(tensors, dim=1) if name.endswith(("attention.dense.weight", "4h_to_h.weight")) else tensors[0]

    for stage, ranks in enumerate(files):
        models = [rank["model"]["language_model"] for rank in ranks]
        for name in models[0]["encoder"]:
            parts = name.split(".")
            ours = ".".join(["layers", str(stage * per_stage + int(parts[1]))] + parts[2:]) if parts[0] == "layers" else name
            full[ours] = joined(name, [model["encoder"][name] for model in models])
        for module, tensors in models[0].get("embedding", {}).items():
            for p in tensors:
                full[f"embedding.{module}.{p}"] = joined(f"{module}.{p}", [m["embedding"][module][p] for m in models])
        if "word_embeddings_for_head" in ranks[0]["model"]:
            full["head"] = torch.cat([rank["model"]["word_embeddings_for_head"]["weight"] for rank in ranks])
    return full, [rank for ranks in files for rank in ranks]


@pytest.mark.parametrize("tp, pp, release", [(2, 2, False), (1, 1, True)])
def test_megatron_lm_layout_holds_the_source_tensors(source, tmp_path, tp, pp, release):
    output = str(tmp_path / "megatron")
    assert deepspeed_to_megatron.main(["--input_folder", source[0], "--output_folder", output, "--target_tp", str(tp),
                                       "--target_pp", str(pp)] + ["--for_release"] * release) == 0
    name = "release" if release else "iter_0000002"
    with open(os.path.join(output, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == ("release" if release else "2")
    checkpoint = open_checkpoint(source[0])
    expected = full_model_state(checkpoint)
    found, files = megatron_lm_tensors(os.path.join(output, name), tp, pp)
    if pp > 1:
        assert torch.equal(found.pop("head"), expected["embedding.word_embeddings.weight"])
    assert sorted(found) == sorted(expected)
    assert all(torch.equal(found[key], expected[key]) for key in expected)
    for saved in files:
        arguments = saved["args"]
        assert (arguments.tensor_model_parallel_size, arguments.pipeline_model_parallel_size) == (tp, pp)
        assert arguments.hidden_size == checkpoint.model["hidden_size"] and saved["checkpoint_version"] == 3.0
        assert saved["iteration"] == arguments.iteration == (0 if release else 2)
        samples = 0 if release else checkpoint.state["consumed_train_samples"]
        assert arguments.consumed_train_samples == samples and (release or samples == 2 * GLOBAL_BATCH)


def test_megatron_lm_layout_needs_equal_stages(source, tmp_path, capsys):
    output = str(tmp_path / "megatron")
    assert deepspeed_to_megatron.main(["--input_folder", source[0], "--output_folder", output, "--target_pp", "3"]) == 1
    assert "--target_pp 3: Megatron-LM gives every stage the same number of layers" in capsys.readouterr().err
    assert not os.path.exists(output)


@pytest.fixture(scope="module")
def llama_source(llama_saving_run) -> tuple[str, list[float], list[float]]:
    """(the Llama-class TP=2 x PP=2 run's global_step2 directory, its losses, its learning rates)."""
    tag = os.path.join(str(llama_saving_run["save"]), f"global_step{LLAMA_SAVE_ITERATION}")
    return tag, llama_saving_run["loss"], llama_saving_run["lr"]


def assert_llama_resumes_with_source_loss(data, llama_source, load: str, processes: int, layout: list[str],
                                          tensorboard: str):
    _, losses, rates = llama_source
    result = run_pretrain(llama_flags(data) + layout + ["--load", load, "--no-load-optim", "--no-load-rng",
                                                        "--tensorboard-dir", tensorboard], nproc=processes, timeout=600)
    result.assert_ok()
    found = read_scalars(tensorboard)
    assert series(found, LOSS_TAG, [3, 4])[0] == pytest.approx(losses[2], rel=1e-6)
    assert series(found, LR_TAG, [3, 4]) == rates[2:]


def test_llama_merged_to_tp1_gives_the_source_loss(e2e_data, llama_source, tmp_path, capsys):
    merged = str(tmp_path / "merged")
    assert merge_mp_partitions.main(["--model-type", "GPT", "--tensor-model-parallel-size", "2", "--load",
                                     llama_source[0], "--save", str(tmp_path / "refused"), "--group-query-attention",
                                     "--num-query-groups", "4"]) == 1
    assert "--num-query-groups 4: the checkpoint's model has 2" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "refused")
    assert merge_mp_partitions.main(["--model-type", "GPT", "--tensor-model-parallel-size", "2", "--load",
                                     llama_source[0], "--save", merged, "--num-layers", str(LLAMA_NUM_LAYERS),
                                     "--num-key-value-heads", "2"]) == 0
    tag = os.path.join(merged, "global_step2")
    head = f"layer_{LLAMA_NUM_LAYERS + 5:02d}-model_00-model_states.pt"
    assert sorted(name for name in os.listdir(tag) if name.startswith("layer_")) == [
        f"layer_{layer:02d}-model_00-model_states.pt" for layer in (1, 3, 4, 6)] + [head]
    source = open_checkpoint(llama_source[0])
    expected = full_model_state(source)
    assert torch.equal(torch.load(os.path.join(tag, head), weights_only=True)["weight"], expected["output_layer.weight"])
    assert_llama_resumes_with_source_loss(e2e_data, llama_source, merged, 1, [], str(tmp_path / "tb"))


def test_llama_reshaped_to_tp1_pp2_gives_the_source_loss(e2e_data, llama_source, tmp_path):
    reshaped = str(tmp_path / "tp1_pp2")
    assert deepspeed_to_deepspeed.main(["--input_folder", llama_source[0], "--output_folder", reshaped,
                                        "--target_tp", "1", "--target_pp", "2"]) == 0
    assert_llama_resumes_with_source_loss(e2e_data, llama_source, reshaped, 2, ["--pipeline-model-parallel-size", "2"],
                                          str(tmp_path / "tb"))


def test_llama_more_tp_ranks_than_key_value_groups_are_refused(llama_source, tmp_path, capsys):
    outputs = [str(tmp_path / "reshaped"), str(tmp_path / "megatron")]
    assert deepspeed_to_deepspeed.main(["--input_folder", llama_source[0], "--output_folder", outputs[0],
                                        "--target_tp", "4"]) == 1
    assert deepspeed_to_megatron.main(["--input_folder", llama_source[0], "--output_folder", outputs[1],
                                       "--target_tp", "4"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and all("--target_tp 4: the TP ranks split the model's 2 key/value groups" in line
                                    for line in errors), errors
    assert not any(os.path.exists(path) for path in outputs)


def test_llama_megatron_lm_layout_holds_the_untied_head_and_grouped_qkv(llama_source, tmp_path):
    """TP=2 x PP=2: the last stage's ``output_layer`` holds each rank's vocabulary half of the untied head
    and no tied head copy; each rank's QKV holds its key/value group's (2 + 2) x 16 rows, the source's
    rows of that group; ``args`` name the options as Megatron-LM does."""
    output = str(tmp_path / "megatron")
    assert deepspeed_to_megatron.main(["--input_folder", llama_source[0], "--output_folder", output,
                                       "--target_tp", "2", "--target_pp", "2"]) == 0
    expected = full_model_state(open_checkpoint(llama_source[0]))
    root = os.path.join(output, "iter_0000002")
    heads, qkv = [], []
    for rank in range(2):
        last = torch.load(os.path.join(root, f"mp_rank_{rank:02d}_001", "model_optim_rng.pt"), weights_only=False)
        first = torch.load(os.path.join(root, f"mp_rank_{rank:02d}_000", "model_optim_rng.pt"), weights_only=False)
        assert "word_embeddings_for_head" not in last["model"]
        heads.append(last["model"]["language_model"]["output_layer"]["weight"])
        qkv.append(first["model"]["language_model"]["encoder"]["layers.0.self_attention.query_key_value.weight"])
        arguments = last["args"]
        assert (arguments.group_query_attention, arguments.num_query_groups, arguments.swiglu,
                arguments.position_embedding_type, arguments.normalization, arguments.add_bias_linear,
                arguments.untie_embeddings_and_output_weights) == (True, 2, True, "rope", "RMSNorm", False, True)
    assert torch.equal(torch.cat(heads), expected["output_layer.weight"])
    assert [tuple(t.shape) for t in qkv] == [(64, 64)] * 2
    assert torch.equal(torch.cat(qkv), expected["layers.0.self_attention.query_key_value.weight"])
