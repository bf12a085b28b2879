"""Llama-class models through tools/convert_checkpoint: transformers_to_megatron.py imports tiny random
LlamaForCausalLM (grouped-query attention, 4 heads over 2 groups, SwiGLU, RoPE base 500000, untied, no
biases), its Llama 3.x rope-scaled form, Qwen2ForCausalLM (QKV bias), MistralForCausalLM and Llama with
biases on every linear layer; deepspeed_to_transformers.py exports them back.

* In this process: each import at TP=2 x PP=2, merged into one model, gives transformers' logits and
  loss, and exported again gives back transformers' tensors; the tokenizer files travel both ways; what
  cannot be expressed is refused by name with nothing left on disk.
* End to end (slow): the Llama import at TP=2 x PP=2 and at TP=1 trains with pretrain_gpt.py and the
  model flags the import printed (4 and 1 gloo processes, 3 iterations, the same data): the first loss
  is transformers' on the first global batch and the two runs' losses agree; the trained TP=2 x PP=2 checkpoint exported gives a
  transformers model whose loss is ours and whose greedy ``generate`` is generate_samples_gpt.py's.

Tolerances: 1e-5 relative (fp32 on both sides, the sums run in another order; logits relative to the
largest).
"""
import contextlib
import dataclasses
import io
import json
import os
import shutil

import pytest
import torch

from megatron.core.checkpoint.model_loading import load_gpt_model
from megatron.core.checkpoint.reader import open_checkpoint
from tests.conftest import REPO_ROOT
from tests.tools.test_transformers_to_megatron import transformers_loss
from tests.training.e2e_utils import read_scalars, run_pretrain, run_script
from tests.training.reference_loop import global_batch, training_dataset
from tests.training.test_layout_equivalence import SEED, common_flags, series
from tools.convert_checkpoint import deepspeed_to_transformers, transformers_to_megatron

VOCABULARY, POSITIONS, SEQ_LENGTH, GLOBAL_BATCH, TRAIN_ITERS = 1000, 80, 32, 4, 3  # the sample tokenizer: 1000
SIZES = dict(vocab_size=VOCABULARY, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=POSITIONS, rms_norm_eps=1e-5, tie_word_embeddings=False)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}
MODELS = {  # name -> (transformers class, its configuration)
    "llama": ("Llama", dict(rope_theta=500000.0)),
    "llama3-scaled": ("Llama", dict(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)),
    "qwen2": ("Qwen2", dict(rope_theta=1000000.0)),
    "mistral": ("Mistral", dict(sliding_window=None, head_dim=32)),
    "llama-biases": ("Llama", dict(attention_bias=True, mlp_bias=True)),
}
TOOL = os.path.join(REPO_ROOT, "tools", "generate_samples_gpt.py")


def tiny_model(name: str = "llama", **changes):
    """A random transformers model of ``MODELS[name]``, its norms and biases drawn away from 1 and 0 so
    that a misplaced one shows."""
    import transformers

    family, options = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**{**SIZES, **options, **changes})
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "norm" in parameter_name:
                parameter.normal_(1.0, 0.2)
            elif parameter_name.endswith(".bias"):
                parameter.normal_(0.0, 0.2)
    return model


def import_model(source: str, output: str, *extra) -> int:
    return transformers_to_megatron.main(["--input_folder", source, "--output_folder", output, *extra])


def sample_tokens(batch: int = 2, length: int = 48) -> torch.Tensor:
    return torch.randint(0, VOCABULARY, (batch, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_import_at_tp2_pp2_gives_transformers_loss_and_exports_back(name, tmp_path):
    import transformers

    model = tiny_model(name)
    source, imported, exported = (str(tmp_path / part) for part in ("hf", "imported", "exported"))
    model.save_pretrained(source, max_shard_size="200KB")  # shards and their index, read one layer at a time
    assert os.path.exists(os.path.join(source, "model.safetensors.index.json"))
    assert import_model(source, imported, "--target_tp", "2", "--target_pp", "2") == 0
    tokens = sample_tokens()
    ours = load_gpt_model(open_checkpoint(imported), use_cpu_initialization=True)
    with torch.no_grad():
        our_logits, their_logits = ours(tokens), model(tokens).logits
    assert (our_logits - their_logits).abs().max() <= 1e-5 * their_logits.abs().max()
    loss = ours(tokens[:, :-1], labels=tokens[:, 1:]).item()
    assert loss == pytest.approx(transformers_loss(model, tokens), rel=1e-5)

    assert deepspeed_to_transformers.main(["--input_folder", imported, "--output_folder", exported]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    expected = "Qwen2ForCausalLM" if name == "qwen2" else "LlamaForCausalLM"  # Mistral without a window is Llama
    assert type(back).__name__ == expected
    original, returned = model.state_dict(), back.state_dict()
    assert set(original) == set(returned)
    assert all(torch.equal(original[key], returned[key]) for key in original)


def test_import_prints_the_flags_of_the_llama_options(tmp_path, capsys):
    source = str(tmp_path / "hf")
    tiny_model("llama3-scaled").save_pretrained(source)
    assert import_model(source, str(tmp_path / "imported"), "--target_tp", "2", "--seq_length", "32") == 0
    summary = capsys.readouterr().out
    for flags in ("--seq-length 32 --max-position-embeddings 80 --position-embedding-type rotary",
                  "--swiglu --normalization RMSNorm --group-query-attention --num-query-groups 2 --rotary-base 500000",
                  "--use-rope-scaling --rope-scaling-factor 8.0 --rope-scaling-low-freq-factor 1.0 "
                  "--rope-scaling-high-freq-factor 4.0 --rope-scaling-original-max-position-embeddings 16",
                  "--untie-embeddings-and-output-weights --disable-bias-linear"):
        assert flags in summary
    source = str(tmp_path / "qwen")
    tiny_model("qwen2", tie_word_embeddings=True).save_pretrained(source)
    assert import_model(source, str(tmp_path / "qwen_imported")) == 0
    summary = capsys.readouterr().out
    assert "--disable-bias-linear --add-qkv-bias" in summary and "--untie" not in summary


def edit_config(directory: str, **changes) -> None:
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("changes, extra, named", [
    ({"model_type": "mistral", "sliding_window": 16}, [],
     "sliding_window 16 (sliding-window attention; only sequences of at most 16 positions"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16}, ["--seq_length", "32"],
     "sliding_window 16"),
    ({"num_local_experts": 8}, [], "num_local_experts 8 (mixture-of-experts layers)"),
    ({"num_key_value_heads": 3}, [], "num_attention_heads 4 that num_key_value_heads 3 do not divide"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}}, [],
     "rope scaling type 'yarn' (only llama3 frequency scaling, or none, is implemented)"),
    ({"rope_parameters": None, "rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}, [],
     "rope scaling type 'linear'"),
    ({"attention_bias": True}, [], "attention_bias without mlp_bias"),
    ({"mlp_bias": True}, [], "mlp_bias without attention_bias"),
    ({"hidden_act": "gelu"}, [], "hidden_act gelu"),
    ({"model_type": "mixtral", "num_local_experts": 8}, [], "model_type 'mixtral' (mixture-of-experts layers)"),
    ({}, ["--target_tp", "4"], "--target_tp 4: the TP ranks split the model's 2 key/value groups"),
])
def test_what_cannot_be_expressed_is_refused_by_name_and_nothing_written(changes, extra, named, tmp_path, capsys):
    source, output = str(tmp_path / "hf"), str(tmp_path / "imported")
    tiny_model("llama").save_pretrained(source)
    edit_config(source, **changes)
    assert import_model(source, output, *extra) == 1
    assert named in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_a_window_longer_than_the_sequences_imports_as_full_attention(tmp_path, capsys):
    source = str(tmp_path / "hf")
    tiny_model("mistral", sliding_window=40).save_pretrained(source)
    assert import_model(source, str(tmp_path / "imported"), "--seq_length", "32") == 0
    assert "--seq-length 32 --max-position-embeddings 40" in capsys.readouterr().out


def tokenizer_round_trip(model, source: str, tmp_path) -> tuple[dict, str]:
    """(the imported checkpoint's tokenizer settings, the exported directory) of ``model`` saved with the
    tokenizer files already in ``source``."""
    imported, exported = str(tmp_path / "imported"), str(tmp_path / "exported")
    model.save_pretrained(source)
    assert import_model(source, imported) == 0
    data = open_checkpoint(imported).state["args"]["config"]["data"]
    assert deepspeed_to_transformers.main(["--input_folder", imported, "--output_folder", exported]) == 0
    return data, exported


def assert_same_tokenizer(data: dict, exported: str) -> None:
    """transformers' tokenizer of ``exported`` gives the ids our generation starts from (the BOS
    included), and config.json the same bos and eos."""
    import transformers

    from megatron.core.tokenizer import bos_of, build_tokenizer, prompt_tokens

    ours = build_tokenizer(**{key: value for key, value in data.items() if key != "orig_vocab_size"})
    theirs = transformers.AutoTokenizer.from_pretrained(exported, local_files_only=True)
    text = "The history of the Python language, in 1990."
    assert theirs(text)["input_ids"] == prompt_tokens(ours, text)
    config = transformers.AutoConfig.from_pretrained(exported, local_files_only=True)
    assert (config.bos_token_id, config.eos_token_id) == (bos_of(ours), ours.eod)
    assert bos_of(ours) is not None


def test_a_tokenizer_json_travels_both_ways(e2e_data, tmp_path, capsys):
    from tests.core.tokenizer.llama_style import write_llama3_style

    source = str(tmp_path / "hf")
    write_llama3_style(source, e2e_data.vocab_file, e2e_data.merge_file)  # 1000 tokens, then its BOS and EOS
    for name, path in (("vocab.json", e2e_data.vocab_file), ("merges.txt", e2e_data.merge_file)):
        shutil.copyfile(path, os.path.join(source, name))  # as Qwen2 ships them: the tokenizer.json still rules
    data, exported = tokenizer_round_trip(tiny_model("llama", vocab_size=VOCABULARY + 2), source, tmp_path)
    tokenizer = str(tmp_path / "imported" / "tokenizer")
    assert f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tokenizer}" in capsys.readouterr().out
    assert data == {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": tokenizer,
                    "orig_vocab_size": VOCABULARY + 2}
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(exported))
    assert_same_tokenizer(data, exported)


def test_a_sentencepiece_model_travels_both_ways(tmp_path, capsys):
    from tests.core.tokenizer.llama_style import train_sentencepiece

    pytest.importorskip("sentencepiece")
    source = str(tmp_path / "hf")
    os.makedirs(source)
    train_sentencepiece(os.path.join(source, "tokenizer.model"), vocab_size=VOCABULARY)
    data, exported = tokenizer_round_trip(tiny_model("llama"), source, tmp_path)
    model_file = str(tmp_path / "imported" / "tokenizer" / "tokenizer.model")
    assert f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {model_file}" in capsys.readouterr().out
    assert {"tokenizer.model", "tokenizer_config.json"} <= set(os.listdir(exported))
    assert_same_tokenizer(data, exported)


def write_model_checkpoint(config, directory: str) -> None:
    """A --save directory holding a random GPTModel of ``config`` at TP = PP = 1, written as an import is."""
    from megatron.core.checkpoint.client_state import imported_checkpoint_state
    from megatron.core.checkpoint.names import EMBEDDING_LAYER, PIPELINE_EMBEDDING_PREFIX, pipeline_name
    from megatron.core.checkpoint.sharding import ModelSharding
    from megatron.core.checkpoint.writer import write_checkpoint
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.parallel_state import single_rank_groups

    layers = {}
    for name, tensor in GPTModel(config, single_rank_groups()).state_dict().items():
        full_name = pipeline_name(name, config.num_layers)
        if full_name.startswith(PIPELINE_EMBEDDING_PREFIX):
            index, key = EMBEDDING_LAYER, full_name[len(PIPELINE_EMBEDDING_PREFIX):]
        else:
            layer, _, key = full_name.partition(".")
            index = int(layer)
        layers.setdefault(index, {})[key] = tensor
    state = imported_checkpoint_state(config, VOCABULARY, 1, 1, {}, "0")
    write_checkpoint(directory, 0, sorted(layers.items()), state, 1, 1, ModelSharding(config))


@pytest.mark.parametrize("changes, named", [
    ({"normalization": "LayerNorm"}, "--normalization LayerNorm"),
    ({"position_embedding_type": "alibi"}, "--position-embedding-type alibi"),
    ({"glu_activation": "geglu"}, "--glu-activation geglu"),
    ({"rotary_percent": 0.5}, "--rotary-percent 0.5 (Llama rotates whole heads)"),
])
def test_export_refuses_what_llama_cannot_express_before_writing(changes, named, tmp_path, capsys):
    from megatron.core.models.gpt.config import GPTModelConfig

    config = GPTModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            padded_vocab_size=VOCABULARY, seq_length=SEQ_LENGTH, max_position_embeddings=POSITIONS,
                            ffn_hidden_size=96, normalization="RMSNorm", glu_activation="swiglu",
                            bias_gelu_fusion=False, position_embedding_type="rotary", add_bias_linear=False,
                            untie_embeddings_and_output_weights=True, use_cpu_initialization=True)
    checkpoint = str(tmp_path / "checkpoint")
    write_model_checkpoint(dataclasses.replace(config, **changes), checkpoint)
    output = str(tmp_path / "exported")
    assert deepspeed_to_transformers.main(["--input_folder", checkpoint, "--output_folder", output]) == 1
    assert named in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["checkpoint"]


# ------------------------------------------------------------------------------------ end to end

LAYOUTS = {"tp2-pp2": (2, 2), "tp1": (1, 1)}


def printed_model_flags(summary: str) -> list[str]:
    """The model (and tokenizer) flags of the import's summary: what comes before the layout and --load."""
    return summary.split("Train it with: ", 1)[1].split(" --tensor-model-parallel-size", 1)[0].split()


@pytest.fixture(scope="module")
def llama_runs(e2e_data, tmp_path_factory):
    """(the transformers model, the model flags the import printed, layout -> (losses, the --save
    directory)) of 3 iterations of pretrain_gpt.py from the Llama import at each layout, with the
    printed flags."""
    directory = tmp_path_factory.mktemp("llama_runs")
    model = tiny_model("llama")
    source = str(directory / "hf")
    model.save_pretrained(source)
    runs = {}
    for name, (tp, pp) in LAYOUTS.items():
        imported, save, tensorboard = (str(directory / f"{part}_{name}") for part in ("imported", "save", "tb"))
        summary = io.StringIO()
        with contextlib.redirect_stdout(summary):
            assert import_model(source, imported, "--target_tp", str(tp), "--target_pp", str(pp),
                                "--seq_length", str(SEQ_LENGTH)) == 0
        model_flags = printed_model_flags(summary.getvalue())
        flags = common_flags(e2e_data, seq_length=SEQ_LENGTH, global_batch=GLOBAL_BATCH, train_iters=TRAIN_ITERS)
        flags += model_flags + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                                "--zero-stage", "1", "--load", imported, "--no-load-optim", "--no-load-rng",
                                "--save", save, "--save-interval", str(TRAIN_ITERS), "--tensorboard-dir", tensorboard]
        run_pretrain(flags, nproc=tp * pp, timeout=600).assert_ok()
        runs[name] = (series(read_scalars(tensorboard), "lm-loss-training/lm loss", range(1, TRAIN_ITERS + 1)), save)
    return model, model_flags, runs


@pytest.mark.slow
@pytest.mark.distributed
def test_imports_train_from_transformers_loss_to_the_same_losses(llama_runs, e2e_data):
    model, _, runs = llama_runs
    dataset = training_dataset(e2e_data.data_prefix, SEQ_LENGTH, SEED, GLOBAL_BATCH, e2e_data.cache_dir)
    expected = transformers_loss(model, global_batch(dataset, 0, GLOBAL_BATCH))
    losses, single = runs["tp2-pp2"][0], runs["tp1"][0]
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    assert losses == pytest.approx(single, rel=1e-5)
    assert len({round(loss, 4) for loss in losses}) == TRAIN_ITERS  # the runs do train


PROMPTS = ["The history of the", "In 1990, a new", "Rome"]
NEW_TOKENS = 10


@pytest.mark.slow
@pytest.mark.distributed
def test_trained_checkpoint_exports_with_our_loss_and_greedy_tokens(llama_runs, e2e_data, tmp_path):
    import transformers

    from megatron.core.tokenizer import GPT2BPETokenizer

    _, model_flags, runs = llama_runs
    save = runs["tp2-pp2"][1]
    exported = str(tmp_path / "exported")
    assert deepspeed_to_transformers.main(["--input_folder", save, "--output_folder", exported]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval()
    assert type(hf_model).__name__ == "LlamaForCausalLM"
    ours = load_gpt_model(open_checkpoint(save), use_cpu_initialization=True)
    dataset = training_dataset(e2e_data.data_prefix, SEQ_LENGTH, SEED, GLOBAL_BATCH, e2e_data.cache_dir)
    tokens = global_batch(dataset, 0, GLOBAL_BATCH)
    with torch.no_grad():
        our_loss = ours(tokens[:, :-1], labels=tokens[:, 1:]).item()
    assert transformers_loss(hf_model, tokens) == pytest.approx(our_loss, rel=1e-5)

    prompts, genfile = tmp_path / "prompts.txt", tmp_path / "samples.jsonl"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    command = [TOOL, "--load", save, *model_flags, "--vocab-file", e2e_data.vocab_file, "--merge-file",
               e2e_data.merge_file,
               "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--greedy",
               "--out-seq-length", str(NEW_TOKENS), "--micro-batch-size", "3", "--sample-input-file", str(prompts),
               "--genfile", str(genfile)]
    run_script(command, 4, timeout=300).assert_ok()
    samples = [json.loads(line) for line in genfile.read_text().splitlines()]
    assert sum(len(sample["tokens"]) for sample in samples) > 2 * NEW_TOKENS  # generation may stop at an eod
    tokenizer = GPT2BPETokenizer(e2e_data.vocab_file, e2e_data.merge_file)
    assert hf_model.config.eos_token_id == tokenizer.eod
    for prompt, sample in zip(PROMPTS, samples, strict=True):
        ids = tokenizer.tokenize(prompt)
        output = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                   eos_token_id=tokenizer.eod, pad_token_id=tokenizer.eod,
                                   attention_mask=torch.ones(1, len(ids)))
        assert output[0, len(ids):].tolist() == sample["tokens"], prompt
