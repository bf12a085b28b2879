"""tools/convert_checkpoint/transformers_to_megatron.py: tiny random GPT2LMHeadModel and BloomForCausalLM
made by transformers, imported at TP=2 x PP=2, give transformers' loss when pretrain_gpt.py trains from
them (4 gloo processes: the first iteration's loss is the imported weights' loss on the first global
batch); exporting the import gives back the same tensors; unsupported models and bad layouts are
refused by name, with no output left.

Tolerance: the loss 1e-5 relative (fp32 on both sides; the sums run in another order), the logits of
the merged import 1e-5 of the largest.
"""
import json
import os

import pytest
import torch

from megatron.core.checkpoint.model_loading import load_gpt_model
from megatron.core.checkpoint.reader import open_checkpoint
from tests.training.e2e_utils import read_scalars, run_pretrain
from tests.training.reference_loop import global_batch, training_dataset
from tests.training.test_layout_equivalence import SEED, common_flags, series
from tools.convert_checkpoint import deepspeed_to_transformers, transformers_to_megatron

VOCABULARY, SEQ_LENGTH, POSITIONS, GLOBAL_BATCH = 1000, 32, 80, 4  # the sample tokenizer has 1000 tokens
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def tiny_model(kind: str, **changes):
    import transformers

    torch.manual_seed(0)
    sizes = {"vocab_size": VOCABULARY, "n_layer": 2, "n_head": 4, **changes}
    if kind == "gpt2":
        config = transformers.GPT2Config(**{"n_positions": POSITIONS, "n_embd": 64, **sizes})
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.BloomConfig(hidden_size=64, **sizes)
    return transformers.BloomForCausalLM(config).eval()


def import_tp2_pp2(model, tmp_path, *extra) -> tuple[str, int]:
    """(the imported --save directory, the tool's exit status) of ``model`` saved by transformers."""
    source, output = str(tmp_path / "hf"), str(tmp_path / "imported")
    model.save_pretrained(source)
    status = transformers_to_megatron.main(["--input_folder", source, "--output_folder", output, "--target_tp", "2",
                                            "--target_pp", "2", *extra])
    return output, status


def transformers_loss(model, tokens: torch.Tensor) -> float:
    """Mean next-token cross-entropy of ``tokens`` [b, s + 1] (every position counts, as in the trainer)."""
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).item()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("kind, load_flags", [("gpt2", ["--no-load-optim", "--no-load-rng"]),
                                              ("bloom", ["--finetune", "--no-load-optim"])])
def test_training_from_the_import_starts_at_transformers_loss(kind, load_flags, e2e_data, tmp_path):
    model = tiny_model(kind)
    imported, status = import_tp2_pp2(model, tmp_path, "--seq_length", str(SEQ_LENGTH))
    assert status == 0
    positions = POSITIONS if kind == "gpt2" else SEQ_LENGTH
    style = [] if kind == "gpt2" else ["--position-embedding-type", "alibi", "--embed-layernorm"]
    tensorboard = str(tmp_path / "tb")
    flags = common_flags(e2e_data, seq_length=SEQ_LENGTH, global_batch=GLOBAL_BATCH, train_iters=1) + TP2_PP2 + style + [
        "--pad-vocab-size-to", str(VOCABULARY), "--make-vocab-size-divisible-by", "1", "--max-position-embeddings",
        str(positions), "--zero-stage", "1", "--load", imported, "--tensorboard-dir", tensorboard] + load_flags
    run_pretrain(flags, nproc=4, timeout=600).assert_ok()
    dataset = training_dataset(e2e_data.data_prefix, SEQ_LENGTH, SEED, GLOBAL_BATCH, e2e_data.cache_dir)
    expected = transformers_loss(model, global_batch(dataset, 0, GLOBAL_BATCH))
    assert series(read_scalars(tensorboard), "lm-loss-training/lm loss", [1]) == pytest.approx([expected], rel=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "bloom"])
def test_export_after_import_returns_the_same_tensors(kind, tmp_path):
    import transformers

    model = tiny_model(kind)
    imported, status = import_tp2_pp2(model, tmp_path, "--seq_length", str(SEQ_LENGTH))
    assert status == 0
    tokens = torch.randint(0, VOCABULARY, (2, SEQ_LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = load_gpt_model(open_checkpoint(imported), use_cpu_initialization=True)(tokens)
        theirs = model(tokens).logits
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    exported = str(tmp_path / "exported")
    assert deepspeed_to_transformers.main(["--input_folder", imported, "--output_folder", exported]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    original, returned = model.state_dict(), back.state_dict()
    assert set(original) == set(returned)
    assert all(torch.equal(original[name], returned[name]) for name in original)


def test_tokenizer_files_travel_and_padding_is_reported(e2e_data, tmp_path, capsys):
    model = tiny_model("gpt2", vocab_size=VOCABULARY + 1)
    source = str(tmp_path / "hf")
    model.save_pretrained(source)
    for name, path in (("vocab.json", e2e_data.vocab_file), ("merges.txt", e2e_data.merge_file)):
        with open(path) as f, open(os.path.join(source, name), "w") as out:
            out.write(f.read())
    output = str(tmp_path / "imported")
    assert transformers_to_megatron.main(["--input_folder", source, "--output_folder", output, "--target_tp",
                                          "2"]) == 0
    summary = capsys.readouterr().out
    assert "padded to 1002 rows (1 zero rows" in summary and "--pad-vocab-size-to 1002" in summary
    checkpoint = open_checkpoint(output)
    assert checkpoint.model["padded_vocab_size"] == 1002 and checkpoint.original_vocab_size == VOCABULARY + 1
    assert checkpoint.state["args"]["config"]["data"]["vocab_file"] == os.path.join(output, "tokenizer", "vocab.json")
    assert sorted(os.listdir(os.path.join(output, "tokenizer"))) == ["merges.txt", "vocab.json"]
    exported = str(tmp_path / "exported")
    assert deepspeed_to_transformers.main(["--input_folder", output, "--output_folder", exported]) == 0
    with open(os.path.join(exported, "config.json")) as f:
        assert json.load(f)["vocab_size"] == VOCABULARY + 1


@pytest.mark.parametrize("change, named", [
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"activation_function": "relu"}, "activation_function relu"),
    ({"tie_word_embeddings": False}, "tie_word_embeddings false"),
])
def test_models_the_trainer_cannot_express_are_refused(change, named, tmp_path, capsys):
    output, status = import_tp2_pp2(tiny_model("gpt2", **change), tmp_path)
    assert status == 1 and named in capsys.readouterr().err
    assert not os.path.exists(output)


def test_bad_inputs_are_named_and_leave_no_output(tmp_path, capsys):
    model = tiny_model("gpt2")
    source = str(tmp_path / "hf")
    model.save_pretrained(source)
    output = str(tmp_path / "out")
    cases = [(["--input_folder", str(tmp_path)], "no config.json"),
             (["--input_folder", source, "--target_tp", "3"], "--target_tp 3"),
             (["--input_folder", source, "--pad_vocab_size_to", "999"], "--pad_vocab_size_to 999")]
    for arguments, named in cases:
        assert transformers_to_megatron.main(arguments + ["--output_folder", output]) == 1
        assert named in capsys.readouterr().err
        assert not os.path.exists(output)
    weights = os.path.join(source, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    assert transformers_to_megatron.main(["--input_folder", source, "--output_folder", output]) == 1
    assert weights in capsys.readouterr().err and not os.path.exists(output)
    assert [name for name in os.listdir(tmp_path) if name.startswith(".")] == []


def test_loading_the_import_without_the_weights_only_flags_names_them(e2e_data, tmp_path):
    source, imported = str(tmp_path / "hf"), str(tmp_path / "imported")
    tiny_model("gpt2").save_pretrained(source)
    assert transformers_to_megatron.main(["--input_folder", source, "--output_folder", imported]) == 0
    flags = common_flags(e2e_data, seq_length=SEQ_LENGTH, global_batch=GLOBAL_BATCH, train_iters=1) + [
        "--pad-vocab-size-to", str(VOCABULARY), "--make-vocab-size-divisible-by", "1", "--load", imported]
    result = run_pretrain(flags, nproc=1, timeout=300)
    assert result.returncode != 0
    assert "holds weights only" in result.output and "load it with --no-load-optim --no-load-rng" in result.output
