"""--use-bnb-optimizer: bitsandbytes' 8-bit AdamW with the embedding's state in 32 bits; refusals that
name the 'bnb' extra; real pretrain_gpt.py runs (bf16 ZeRO-1 over 2 data-parallel ranks) whose resumed
run continues the uninterrupted one. bitsandbytes runs on CPU here; where it is not installed, the tests
that need it are skipped and the refusal is what remains.
"""
import glob
import importlib.util
import os

import pytest
import torch

from megatron.training import bnb_optimizer
from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.bnb_optimizer import BitsAndBytesError, adamw_8bit, with_embedding_in_32_bits
from megatron.training.config import build_config
from megatron.training.engine.model_setup import build_optimizer, weight_decay_groups
from megatron.core.models.gpt import GPTModel, GPTModelConfig
from megatron.core.parallel_state import single_rank_groups
from tests.training.e2e_utils import run_pretrain, tiny_gpt_flags

needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--micro-batch-size", "2",
         "--seq-length", "32", "--max-position-embeddings", "32", "--train-samples", "1000", "--lr", "1e-3",
         "--data-path", "/data/corpus_text_document", "--vocab-file", "vocab.json", "--merge-file", "merges.txt"]


def parse(*extra):
    return parse_args(FLAGS + list(extra), env={}, cuda_available=False)


# ---------------------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, words", [
    (["--optimizer", "sgd"], ["--optimizer adam"]),
    (["--zero-stage", "2"], ["ZeRO stage 0 or 1", "not 2"]),
])
def test_settings_8_bit_adam_cannot_run_with_are_refused(extra, words):
    with pytest.raises(ArgumentError) as info:
        parse("--use-bnb-optimizer", *extra)
    assert all(word in str(info.value) for word in words)


def test_a_missing_bitsandbytes_is_refused_naming_the_extra(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "bitsandbytes" else real_find_spec(name, *args))
    with pytest.raises(ArgumentError) as info:
        parse("--use-bnb-optimizer")
    assert "[bnb]" in str(info.value) and "not installed" in str(info.value)


def test_a_bitsandbytes_that_cannot_run_here_is_refused_naming_the_extra(monkeypatch):
    """The probe step fails (as on a machine without a build for its platform): a clear error, not a crash
    in the first training step."""
    class BrokenAdamW8bit:
        def __init__(self, *args, **kwargs):
            pass

        def step(self):
            raise RuntimeError("no kernel for this device")

    broken = type("bitsandbytes", (), {"__version__": "0.0-test", "optim": type("optim", (), {
        "AdamW8bit": BrokenAdamW8bit})})
    monkeypatch.setattr(bnb_optimizer, "import_bitsandbytes", lambda: broken)
    with pytest.raises(BitsAndBytesError) as info:
        adamw_8bit([{"params": [torch.nn.Parameter(torch.zeros(3))]}], 1e-3, (0.9, 0.95), 1e-8, torch.device("cpu"))
    message = str(info.value)
    assert "cannot run its 8-bit AdamW" in message and "no kernel for this device" in message and "[bnb]" in message


@needs_bnb  # without bitsandbytes the flag is refused at parse time (tested above)
def test_the_flag_makes_the_embedding_stable_and_lets_zero_run_the_optimizer():
    parsed = parse("--use-bnb-optimizer", "--zero-stage", "1")
    config = build_config(parsed, tokenizer_vocab_size=100)
    assert config.model.stable_embedding and config.model.embed_layernorm and config.optimizer.use_bnb_optimizer
    assert config.deepspeed.config["zero_allow_untested_optimizer"] is True
    plain = build_config(parse(), tokenizer_vocab_size=100)
    assert not (plain.model.stable_embedding or plain.model.embed_layernorm or plain.optimizer.use_bnb_optimizer)


# ---------------------------------------------------------------------------------------------------------
# The optimizer
# ---------------------------------------------------------------------------------------------------------
def tiny_model():
    config = GPTModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, padded_vocab_size=128,
                            seq_length=16, max_position_embeddings=16, embed_layernorm=True,
                            stable_embedding=True, use_cpu_initialization=True)
    return GPTModel(config, single_rank_groups())


def test_the_embedding_gets_a_group_of_its_own():
    model = tiny_model()
    embedding = model.embedding.word_embeddings.weight
    groups = with_embedding_in_32_bits(weight_decay_groups(model, 0.1), [embedding])
    assert [len(group["params"]) for group in groups][2] == 1 and groups[2]["params"][0] is embedding
    assert groups[2]["weight_decay"] == 0.1 and groups[2]["optim_bits"] == 32
    assert all(embedding is not param for group in groups[:2] for param in group["params"])
    assert sum(len(group["params"]) for group in groups) == len(list(model.parameters()))


@needs_bnb
def test_8_bit_state_everywhere_but_the_embedding_which_follows_torch_adamw():
    """Through build_optimizer: the embedding's moments are fp32 and its update is torch's AdamW (1e-6);
    the other weights' moments are uint8 codes and their update stays near AdamW's (8-bit rounding)."""
    parsed = parse("--use-bnb-optimizer", "--weight-decay", "0.1", "--adam-beta2", "0.95")
    optimizer_config = build_config(parsed, tokenizer_vocab_size=100).optimizer
    model, reference = tiny_model(), tiny_model()
    start = {name: param.detach().clone() for name, param in model.named_parameters()}
    optimizer = build_optimizer(model, optimizer_config)
    torch_adamw = torch.optim.AdamW(weight_decay_groups(reference, 0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    for step in range(3):
        for net, opt in ((model, optimizer), (reference, torch_adamw)):
            generator = torch.Generator().manual_seed(step)
            for param in net.parameters():
                param.grad = torch.randn(param.shape, generator=generator)
            opt.step()
    embedding = model.embedding.word_embeddings.weight
    assert optimizer.state[embedding]["state1"].dtype == torch.float32
    torch.testing.assert_close(embedding, reference.embedding.word_embeddings.weight, rtol=1e-6, atol=1e-6)
    name = "layers.0.self_attention.query_key_value.weight"
    qkv, reference_qkv = dict(model.named_parameters())[name], dict(reference.named_parameters())[name]
    assert optimizer.state[qkv]["state1"].dtype == torch.uint8
    update, reference_update = qkv.detach() - start[name], reference_qkv.detach() - start[name]
    error = float((update - reference_update).norm() / reference_update.norm())
    assert 0 < error < 0.1, error  # 8-bit moments: close to AdamW's update, not equal


# ---------------------------------------------------------------------------------------------------------
# Real runs: bf16, ZeRO-1 over 2 data-parallel ranks (DeepSpeed's BF16_Optimizer hands the 8-bit AdamW one
# flat tensor per group), 6 iterations; the same run stopped after 3 and resumed.
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(e2e_data, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bnb")
    flags = tiny_gpt_flags(e2e_data, split="100,0,0") + [
        "--use-bnb-optimizer", "--bf16", "--zero-stage", "1", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "6", "--lr", "1e-3", "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters", "0",
        "--attention-dropout", "0", "--hidden-dropout", "0", "--use-cpu-initialization", "--seed", "1234"]
    checkpoints = str(tmp_path / "checkpoints")
    save = ["--save", checkpoints, "--save-interval", "3"]
    results = {"uninterrupted": run_pretrain(flags, nproc=2),
               "first half": run_pretrain(flags + save + ["--exit-interval", "3"], nproc=2)}
    results["second half"] = run_pretrain(flags + save + ["--load", checkpoints], nproc=2)
    for result in results.values():
        result.assert_ok()
    return results, checkpoints


@needs_bnb
@pytest.mark.slow
@pytest.mark.distributed
def test_a_resumed_8_bit_run_continues_the_losses(runs):
    results, checkpoints = runs
    uninterrupted = results["uninterrupted"].log_lines()
    resumed = results["first half"].log_lines() + results["second half"].log_lines()
    assert [line.iteration for line in resumed] == list(range(1, 7))
    for field in ("lm loss", "grad norm", "learning rate"):
        assert [line.fields[field] for line in resumed] == [line.fields[field] for line in uninterrupted]
    assert uninterrupted[-1].number("lm loss") < uninterrupted[0].number("lm loss")
    saved = torch.load(glob.glob(os.path.join(checkpoints, "global_step3", "*optim_states.pt"))[0],
                       map_location="cpu", weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]
    moments = {index: entry["__bnb_optimizer_quant_state__"]["state1"].dtype  # one flat partition per group
               for index, entry in saved["state"].items()}
    bits = [group.get("optim_bits") for group in saved["param_groups"]]
    assert moments[0] == torch.uint8 and bits[0] is None  # the weights
    assert moments[bits.index(32)] == torch.float32  # the embedding's group
