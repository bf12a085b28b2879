"""Megatron-DeepSpeed's checkpoint files read through the allow-list unpickler and translated.

The files here are written as that trainer writes them (its client-state keys, a pickled
argparse.Namespace holding its enum), with tests/training/megatron_deepspeed_checkpoint.py's stand-in
for megatron.enums; tests/training/test_megatron_deepspeed_resume.py resumes whole checkpoints.
"""
import argparse
import os
import sys
from dataclasses import dataclass

import pytest
import torch

from megatron.core.checkpoint import megatron_deepspeed
from tests.training.megatron_deepspeed_checkpoint import PositionEmbeddingType, foreign_enums_module


@dataclass
class FragmentAddress:
    """The shape of DeepSpeed's fragment_address (its class is not imported by the reader)."""

    numel: int
    start: int


class RunsACommand:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.fixture(autouse=True)
def megatron_enums(monkeypatch):
    """Megatron-DeepSpeed's enum module, importable while a test writes its files."""
    monkeypatch.setitem(sys.modules, "megatron.enums", foreign_enums_module())


def their_args(**overrides) -> argparse.Namespace:
    values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, kv_channels=16,
                  padded_vocab_size=1152, seq_length=32, max_position_embeddings=32,
                  position_embedding_type=PositionEmbeddingType.alibi, glu_activation=None, embed_layernorm=True,
                  params_dtype=torch.bfloat16, tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                  data_parallel_size=4, consumed_train_samples=96, consumed_valid_samples=16,
                  consumed_train_tokens=3072, gigaflos_no_embeds=1.5, curriculum_learning=False)
    values.update(overrides)
    return argparse.Namespace(**values)


def model_states(path, args, **extra):
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 12, "tokens": args.consumed_train_tokens,
             "checkpoint_info": {"padded_vocab_size": 1152, "original_vocab_size": 1100},
             "lr_scheduler": {"max_lr": 1e-3, "num_steps": 96}, **extra}
    torch.save(state, path)
    return path


def test_the_namespace_and_enums_are_read_without_their_code(tmp_path):
    path = model_states(tmp_path / "mp_rank_00_model_states.pt", their_args())
    state = megatron_deepspeed.load_file(str(path))
    assert megatron_deepspeed.is_megatron_deepspeed_state(state)
    assert isinstance(state["args"], megatron_deepspeed.SavedArguments)
    assert state["args"].position_embedding_type == "alibi" and state["args"].params_dtype == torch.bfloat16


def test_an_unknown_class_stays_inert_data(tmp_path):
    marker = tmp_path / "ran"
    path = model_states(tmp_path / "mp_rank_00_model_states.pt", their_args(curriculum_scheduler=RunsACommand(marker)))
    state = megatron_deepspeed.load_file(str(path))
    scheduler = state["args"].curriculum_scheduler
    assert isinstance(scheduler, megatron_deepspeed.ForeignObject) and scheduler.cls_name.endswith(".system")
    assert not marker.exists()  # the pickle named os.system; nothing ran


def test_the_state_is_translated_into_our_keys(tmp_path):
    model_states(tmp_path / "mp_rank_00_model_states.pt", their_args(), dp_world_size=4)
    state = megatron_deepspeed.read_checkpoint_state(str(tmp_path))
    assert megatron_deepspeed.is_translated(state)
    assert (state["iteration"], state["consumed_train_samples"], state["consumed_valid_samples"],
            state["consumed_train_tokens"], state["gigaflos_no_embeddings"], state["curriculum_seqlen"]) == \
        (12, 96, 16, 3072, 1.5, None)
    arguments = state["args"]
    assert (arguments["tensor_model_parallel_size"], arguments["pipeline_model_parallel_size"],
            arguments["data_parallel_size"]) == (2, 1, 4)
    assert arguments["model"]["position_embedding_type"] == "alibi" and arguments["model"]["kv_channels"] == 16
    assert "params_dtype" not in arguments["model"]
    assert arguments["megatron_deepspeed_args"]["params_dtype"] == "torch.bfloat16"
    assert state["lr_scheduler"] == {"max_lr": 1e-3, "num_steps": 96}


@pytest.mark.parametrize("options, named", [
    ({"swiglu": True}, "--swiglu"),
    ({"num_key_value_heads": 2}, "--num-key-value-heads 2"),
    ({"normalization": "rmsnorm", "untie_embeddings_and_output_weights": True},
     "--untie-embeddings-and-output-weights, --normalization rmsnorm"),
    ({"add_bias_linear": False, "use_rotary_position_embeddings": True},
     "--use-rotary-position-embeddings, --disable-bias-linear"),
])
def test_a_llama_class_model_of_microsofts_fork_is_refused_by_name(tmp_path, options, named):
    path = model_states(tmp_path / "mp_rank_00_model_states.pt", their_args(**options))
    with pytest.raises(megatron_deepspeed.MegatronDeepSpeedError) as error:
        megatron_deepspeed.read_checkpoint_state(str(tmp_path))
    assert str(error.value) == (f"{path}: a Megatron-DeepSpeed model with {named} is not read here; export it to a "
                                f"Hugging Face Llama directory and import that with "
                                f"tools/convert_checkpoint/transformers_to_megatron.py")


def test_microsofts_defaults_are_read(tmp_path):
    model_states(tmp_path / "mp_rank_00_model_states.pt", their_args(
        swiglu=False, num_key_value_heads=4, normalization="layernorm", add_bias_linear=True,
        untie_embeddings_and_output_weights=False, use_rotary_position_embeddings=False))
    model = megatron_deepspeed.read_checkpoint_state(str(tmp_path))["args"]["model"]
    assert (model["num_layers"], model["normalization"], model["add_bias_linear"]) == (2, "LayerNorm", True)


def test_a_checkpoint_of_ours_is_not_taken_for_theirs(tmp_path):
    torch.save({"args": {"model": {}}, "iteration": 3}, tmp_path / "mp_rank_00_model_states.pt")
    assert megatron_deepspeed.read_checkpoint_state(str(tmp_path)) is None


def test_an_unreadable_file_is_named(tmp_path):
    path = tmp_path / "mp_rank_00_model_states.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(megatron_deepspeed.MegatronDeepSpeedError, match="cannot read .*mp_rank_00_model_states.pt"):
        megatron_deepspeed.read_checkpoint_state(str(tmp_path))


def test_embedding_layernorm_names_become_ours():
    assert megatron_deepspeed.own_name("tied_modules.embed.word_embeddings.norm.weight") == \
        "tied_modules.embed.embed_layernorm.weight"
    assert megatron_deepspeed.own_layer_state({"word_embeddings.norm.bias": 1, "word_embeddings.weight": 2}) == \
        {"embed_layernorm.bias": 1, "word_embeddings.weight": 2}
    assert megatron_deepspeed.own_name("3.input_layernorm.weight") == "3.input_layernorm.weight"


def test_three_groups_merge_into_our_two():
    groups = [{"params": [0, 1], "weight_decay": 0.1, "lr": 1e-3}, {"params": [2], "weight_decay": 0.1, "lr": 1e-3},
              {"params": [3], "weight_decay": 0.0, "lr": 1e-3}]
    assert megatron_deepspeed.merge_parameter_groups(groups) == [
        {"params": [0, 1, 2], "weight_decay": 0.1, "lr": 1e-3}, {"params": [3], "weight_decay": 0.0, "lr": 1e-3}]


def _partition(path, mappings, flats, moments):
    torch.save({"optimizer_state_dict": {
        "param_slice_mappings": mappings, "single_partition_of_fp32_groups": flats,
        "base_optimizer_state": {"state": {group: {"step": 5, "exp_avg": moment, "exp_avg_sq": moment * 2}
                                           for group, moment in enumerate(moments)}}}}, path)


def test_parameter_states_join_the_fragments_of_every_dp_rank(tmp_path):
    """A [2, 3] weight in group 0 split 4 + 2 over two DP ranks, a norm weight [2] in group 1 on rank 1."""
    weight, norm = torch.arange(6.0).view(2, 3), torch.tensor([10.0, 11.0])
    model_states(tmp_path / "mp_rank_00_model_states.pt", their_args(),
                 param_shapes=[{"3.w": torch.Size([2, 3])}, {"tied_modules.embed.word_embeddings.norm.weight":
                                                            torch.Size([2])}])
    _partition(tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt", [{"3.w": FragmentAddress(4, 0)}, {}],
               [weight.flatten()[:4], torch.zeros(0)], [weight.flatten()[:4] + 100, torch.zeros(0)])
    _partition(tmp_path / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
               [{"3.w": FragmentAddress(2, 0)},
                {"tied_modules.embed.word_embeddings.norm.weight": FragmentAddress(2, 0)}],
               [weight.flatten()[4:], norm], [weight.flatten()[4:] + 100, norm + 100])
    states, step = megatron_deepspeed.parameter_states(str(tmp_path), 0)
    assert step == 5 and sorted(states) == ["3.w", "tied_modules.embed.embed_layernorm.weight"]
    assert torch.equal(states["3.w"]["fp32"], weight) and torch.equal(states["3.w"]["exp_avg_sq"], (weight + 100) * 2)
    assert torch.equal(states["tied_modules.embed.embed_layernorm.weight"]["exp_avg"], norm + 100)


def test_partitions_without_slice_mappings_are_refused(tmp_path):
    model_states(tmp_path / "mp_rank_00_model_states.pt", their_args(), param_shapes=[{}])
    torch.save({"optimizer_state_dict": {"base_optimizer_state": {}}},
               tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(megatron_deepspeed.MegatronDeepSpeedError, match="no param_slice_mappings.*--no-load-optim"):
        megatron_deepspeed.parameter_states(str(tmp_path), 0)


def test_a_stage_0_optimizer_state_gets_our_groups_and_another_format_is_refused():
    state = {"state": {0: {"step": 3}}, "param_groups": [{"params": [0], "weight_decay": 0.1},
                                                         {"params": [1], "weight_decay": 0.1},
                                                         {"params": [2], "weight_decay": 0.0}]}
    own = megatron_deepspeed.own_optimizer_state(state, "mp_rank_00_model_states.pt")
    assert [group["params"] for group in own["param_groups"]] == [[0, 1], [2]] and own["state"] == state["state"]
    assert megatron_deepspeed.own_optimizer_state(None, "mp_rank_00_model_states.pt") is None
    with pytest.raises(megatron_deepspeed.MegatronDeepSpeedError, match="mp_rank_00.*--no-load-optim"):
        megatron_deepspeed.own_optimizer_state({"optimizer_state_dict": {}, "fp32_groups_flat": []},
                                               "mp_rank_00_model_states.pt")
