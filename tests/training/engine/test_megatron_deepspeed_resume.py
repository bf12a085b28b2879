"""A checkpoint written by Megatron-DeepSpeed (BigScience's fork) is resumed by --load when the layout
matches, refused with the conversion advice when it does not, and taken in by ds_to_universal.py.

The checkpoint comes from tests/training/megatron_deepspeed_checkpoint.py: pretrain_gpt.py with
Megatron-DeepSpeed's optimizer groups (three) and its save path (pickled argparse.Namespace, its
client-state keys, its parameter names, DeepSpeed's files and ``latest`` only). That run trains 4
iterations at TP 1, PP 1, DP 2, ZeRO 1, fp32, dropout 0 (test_layout_equivalence's flags), with
--embed-layernorm (BLOOM's, named otherwise there), and saves at 2 and 4: it is the uninterrupted
reference. A run of this trainer resumed from its global_step2 must log the same losses (1e-5
relative; the split of the weight-decay group changes only the order of sums), learning rates and
consumed samples and tokens at iterations 3 and 4: the weights, the Adam moments and step, the LR
schedule and the data position all came through.
"""
import os
import pickletools
import zipfile

import pytest
import torch

from megatron.core.checkpoint import megatron_deepspeed
from megatron.core.checkpoint.manifest import MANIFEST_NAME
from megatron.training.log_reader import iteration_records
from tests.conftest import REPO_ROOT
from tests.training.e2e_utils import read_scalars, run_pretrain, run_script
from tests.training.test_layout_equivalence import WEIGHT_DECAY, common_flags, series
from tools.convert_checkpoint import ds_to_universal

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

FIXTURE = os.path.join(REPO_ROOT, "tests", "training", "megatron_deepspeed_checkpoint.py")
TRAIN_ITERS, SAVE_ITERATION = 4, 2
RESUMED = list(range(SAVE_ITERATION + 1, TRAIN_ITERS + 1))
LOSS_TAG, LR_TAG = "lm-loss-training/lm loss", "learning-rate/learning-rate"
EMBED_LAYERNORM = ("--embed-layernorm",)  # BLOOM's; its parameters are named otherwise there


def flags(data, tensorboard: str, tp: int = 1, zero_stage: int = 1, pp: int = 1) -> list[str]:
    return common_flags(data, seq_length=32, num_layers=2, global_batch=4, train_iters=TRAIN_ITERS) + [
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--zero-stage", str(zero_stage), "--tensorboard-dir", tensorboard]


def run_foreign(data, directory, nproc: int = 2, zero_stage: int = 1, pp: int = 1, extra: tuple = ()) -> dict:
    """The Megatron-DeepSpeed-format run: {"scalars", "output", "save"}."""
    save = str(directory / "checkpoints")
    result = run_script([FIXTURE, *flags(data, str(directory / "tb"), zero_stage=zero_stage, pp=pp), *extra,
                         "--save", save, "--save-interval", str(SAVE_ITERATION)], nproc=nproc, timeout=600)
    result.assert_ok()
    return {"scalars": read_scalars(str(directory / "tb")), "output": result.output, "save": save}


@pytest.fixture(scope="module")
def foreign_run(e2e_data, tmp_path_factory):
    return run_foreign(e2e_data, tmp_path_factory.mktemp("megatron_deepspeed"), extra=EMBED_LAYERNORM)


def rolled_back(save: str) -> str:
    """``save`` with ``latest`` naming global_step2, as a user rolls back."""
    with open(os.path.join(save, "latest"), "w") as f:
        f.write(f"global_step{SAVE_ITERATION}")
    return save


def counters(output: str) -> list[tuple[str, str]]:
    records = {record.iteration: record.fields for record in iteration_records(output)}
    return [(records[i]["consumed samples"], records[i]["consumed tokens"]) for i in RESUMED]


def assert_continues(source: dict, resumed: dict, rtol: float) -> None:
    expected = series(source["scalars"], LOSS_TAG, range(1, TRAIN_ITERS + 1))[SAVE_ITERATION:]
    assert series(resumed["scalars"], LOSS_TAG, RESUMED) == pytest.approx(expected, rel=rtol)
    assert (series(resumed["scalars"], LR_TAG, RESUMED)
            == series(source["scalars"], LR_TAG, range(1, TRAIN_ITERS + 1))[SAVE_ITERATION:])
    assert counters(resumed["output"]) == counters(source["output"])


def test_the_fixture_writes_megatron_deepspeeds_files(foreign_run):
    tag = os.path.join(foreign_run["save"], f"global_step{SAVE_ITERATION}")
    assert sorted(os.listdir(tag)) == ["layer_01-model_00-model_states.pt", "layer_03-model_00-model_states.pt",
                                       "layer_04-model_00-model_states.pt", "layer_06-model_00-model_states.pt",
                                       "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                       "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert not os.path.exists(os.path.join(tag, MANIFEST_NAME))
    assert not os.path.exists(os.path.join(foreign_run["save"], "latest_checkpointed_iteration.txt"))
    with zipfile.ZipFile(os.path.join(tag, "mp_rank_00_model_states.pt")) as archive:
        pickled = archive.read(next(name for name in archive.namelist() if name.endswith("data.pkl")))
    globals_named = {argument for opcode, argument, _ in pickletools.genops(pickled) if opcode.name == "GLOBAL"}
    assert {"argparse Namespace", "megatron.enums PositionEmbeddingType"} <= globals_named
    state = megatron_deepspeed.load_file(os.path.join(tag, "mp_rank_00_model_states.pt"))
    assert megatron_deepspeed.is_megatron_deepspeed_state(state)
    assert {"args", "checkpoint_version", "iteration", "tokens", "checkpoint_info", "random_rng_state",
            "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states"} <= set(state)
    assert "consumed_train_samples" not in state and "manifest" not in state  # counters only inside args
    args = state["args"]
    assert (args.consumed_train_samples, args.consumed_train_tokens, state["tokens"]) == (8, 8 * 32, 8 * 32)
    assert args.position_embedding_type == "absolute" and state["iteration"] == SAVE_ITERATION
    assert sorted(state["lr_scheduler"]) == sorted(["max_lr", "warmup_steps", "num_steps", "warmup_tokens",
                                                    "num_tokens", "decay_style", "decay_steps", "min_lr"])
    partition = megatron_deepspeed.load_file(os.path.join(tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    mappings = partition["optimizer_state_dict"]["param_slice_mappings"]
    assert len(mappings) == 3  # its three parameter groups
    names = {name for group in mappings for name in group} | {name for group in state["param_shapes"] for name in group}
    assert "tied_modules.embed.word_embeddings.norm.weight" in names and not any("embed_layernorm" in n for n in names)
    embedding = megatron_deepspeed.load_file(os.path.join(tag, "layer_01-model_00-model_states.pt"))
    assert {"word_embeddings.weight", "word_embeddings.norm.weight", "word_embeddings.norm.bias"} <= set(embedding)


def test_load_continues_the_megatron_deepspeed_run(foreign_run, e2e_data, tmp_path):
    load = rolled_back(foreign_run["save"])
    save = str(tmp_path / "ours")
    result = run_pretrain(flags(e2e_data, str(tmp_path / "tb")) + [*EMBED_LAYERNORM, "--load", load, "--save", save,
                                                                     "--save-interval", str(TRAIN_ITERS)], nproc=2)
    result.assert_ok()
    output = result.output
    assert f"successfully loaded checkpoint from {load} at iteration {SAVE_ITERATION}" in output
    assert output.count("was written by Megatron-DeepSpeed (no manifest)") == 1
    assert_continues(foreign_run, {"scalars": read_scalars(str(tmp_path / "tb")), "output": output}, rtol=1e-5)
    assert os.path.exists(os.path.join(save, f"global_step{TRAIN_ITERS}", MANIFEST_NAME))  # saved as ours


def test_load_continues_a_zero_stage_0_run(e2e_data, tmp_path):
    """fp32 at ZeRO stage 0: the torch optimizer's state, three groups, in the model-states file."""
    source = run_foreign(e2e_data, tmp_path / "source", nproc=1, zero_stage=0)
    saved = megatron_deepspeed.load_file(os.path.join(source["save"], f"global_step{SAVE_ITERATION}",
                                                      "mp_rank_00_model_states.pt"))
    assert len(saved["optimizer"]["param_groups"]) == 3
    result = run_pretrain(flags(e2e_data, str(tmp_path / "tb"), zero_stage=0) + ["--load", rolled_back(source["save"])])
    result.assert_ok()
    assert_continues(source, {"scalars": read_scalars(str(tmp_path / "tb")), "output": result.output}, rtol=1e-5)


def test_load_continues_a_bf16_pipeline_run(e2e_data, tmp_path):
    """bf16 (BLOOM's precision) at PP 2: DeepSpeed's bf16 optimizer writes bf16_zero_pp_rank partitions,
    one model-parallel rank per stage; the tied embedding is on both stages."""
    source = run_foreign(e2e_data, tmp_path / "source", pp=2, extra=("--bf16", *EMBED_LAYERNORM))
    tag = os.path.join(source["save"], f"global_step{SAVE_ITERATION}")
    assert {"bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
            "layer_06-model_00-model_states.pt"} <= set(os.listdir(tag))
    result = run_pretrain(flags(e2e_data, str(tmp_path / "tb"), pp=2) + ["--bf16", *EMBED_LAYERNORM, "--load",
                                                                         rolled_back(source["save"])], nproc=2)
    result.assert_ok()
    assert_continues(source, {"scalars": read_scalars(str(tmp_path / "tb")), "output": result.output}, rtol=1e-5)


def test_another_layout_is_refused_with_the_conversion_advice(foreign_run, e2e_data, tmp_path):
    load = rolled_back(foreign_run["save"])
    result = run_pretrain(flags(e2e_data, str(tmp_path / "tb"), tp=2) + [*EMBED_LAYERNORM, "--load", load], nproc=2)
    assert result.returncode != 0
    assert "saved with --tensor-model-parallel-size 1" in result.output
    assert "tools/convert_checkpoint/ds_to_universal.py" in result.output
    assert "Traceback" not in result.output


def test_ds_to_universal_takes_it_in(foreign_run, e2e_data, tmp_path, capsys):
    load = str(tmp_path / "load")
    os.makedirs(load)
    status = ds_to_universal.main(["--input_folder", os.path.join(foreign_run["save"], f"global_step{SAVE_ITERATION}"),
                                   "--output_folder", os.path.join(load, f"global_step{SAVE_ITERATION}_universal"),
                                   "--num_extract_workers", "1"])
    assert status == 0 and f"universal checkpoint of iteration {SAVE_ITERATION}" in capsys.readouterr().out
    # its three optimizer groups are our two: the loader gives our groups the saved settings in order
    saved = torch.load(os.path.join(load, f"global_step{SAVE_ITERATION}_universal", "zero", "optimizer_state.pt"),
                       weights_only=False)
    assert [group["weight_decay"] for group in saved["param_groups"]] == [WEIGHT_DECAY, 0.0]
    result = run_pretrain(flags(e2e_data, str(tmp_path / "tb"), tp=2) + [*EMBED_LAYERNORM, "--load", load,
                                                                       "--universal-checkpoint"], nproc=2)
    result.assert_ok()
    assert f"successfully loaded checkpoint from {load} at iteration {SAVE_ITERATION}" in result.output
    assert_continues(foreign_run, {"scalars": read_scalars(str(tmp_path / "tb")), "output": result.output}, rtol=1e-5)
