"""The recompute flags: Megatron-LM's (--recompute-granularity, --recompute-method, --recompute-num-layers,
--recompute-activations, --recompute-modules) and Megatron-DeepSpeed's (--checkpoint-activations,
--checkpoint-num-layers) set one model config; contradictions are one line naming the flags, before
any process group; the log's TFLOPs field counts each mode's recomputed work, model TFLOP/s none."""
import dataclasses

import pytest

from megatron.core.models.gpt.config import SELECTIVE_RECOMPUTE_DEFAULT
from megatron.training import throughput
from megatron.training.arguments import ArgumentError
from megatron.training.config import build_config
from tests.core.models.gpt.gpt_test_utils import tiny_config
from tests.training.e2e_utils import run_pretrain, tiny_gpt_flags
from tests.training.test_arguments import parse

FULL = ["--recompute-granularity", "full"]


def model(extra):
    config = build_config(parse(extra), tokenizer_vocab_size=1000).model
    return (config.checkpoint_activations, config.recompute_method, config.checkpoint_num_layers,
            config.recompute_modules)


def refusal(extra):
    with pytest.raises(ArgumentError) as info:
        build_config(parse(extra), tokenizer_vocab_size=1000)
    return str(info.value)


@pytest.mark.parametrize("flags, expected", [
    ([], (False, "uniform", 1, ())),
    (["--checkpoint-activations"], (True, "uniform", 1, ())),
    (["--checkpoint-activations", "--checkpoint-num-layers", "2"], (True, "uniform", 2, ())),
    (FULL, (True, "uniform", 1, ())),
    (FULL + ["--recompute-method", "uniform", "--recompute-num-layers", "2"], (True, "uniform", 2, ())),
    (FULL + ["--recompute-method", "block", "--recompute-num-layers", "2"], (True, "block", 2, ())),
    (["--checkpoint-activations", "--recompute-method", "block"], (True, "block", 1, ())),
    (["--checkpoint-activations", "--recompute-granularity", "full", "--checkpoint-num-layers", "2",
      "--recompute-num-layers", "2"], (True, "uniform", 2, ())),
    (["--recompute-activations"], (False, "uniform", 1, SELECTIVE_RECOMPUTE_DEFAULT)),
    (["--recompute-granularity", "selective"], (False, "uniform", 1, SELECTIVE_RECOMPUTE_DEFAULT)),
    (["--recompute-activations", "--recompute-method", "block", "--recompute-num-layers", "2"],
     (False, "block", 2, SELECTIVE_RECOMPUTE_DEFAULT)),
    (["--recompute-activations", "--recompute-modules", "core_attn", "mlp", "core_attn"],
     (False, "uniform", 1, ("core_attn", "mlp"))),
    (["--recompute-activations", "--deterministic"],
     (False, "uniform", 1, ("core_attn",) + SELECTIVE_RECOMPUTE_DEFAULT)),
    (["--recompute-activations", "--apply-residual-connection-post-layernorm"],
     (False, "uniform", 1, tuple(m for m in SELECTIVE_RECOMPUTE_DEFAULT if m != "layernorm"))),
])
def test_flags_set_the_model_config(flags, expected):
    assert model(flags) == expected


@pytest.mark.parametrize("flags, words", [
    (["--checkpoint-activations", "--recompute-activations"], ["--checkpoint-activations", "--recompute-activations"]),
    (["--checkpoint-activations", "--recompute-granularity", "selective"],
     ["--checkpoint-activations", "--recompute-granularity selective"]),
    (["--recompute-activations", "--recompute-granularity", "full"],
     ["--recompute-activations", "--recompute-granularity full"]),
    (FULL + ["--checkpoint-num-layers", "2", "--recompute-num-layers", "3"],
     ["--recompute-num-layers 3", "--checkpoint-num-layers 2"]),
    (["--recompute-method", "block"], ["--recompute-method", "--recompute-granularity full"]),
    (["--recompute-activations", "--recompute-num-layers", "2"], ["--recompute-num-layers", "--recompute-method block"]),
    (["--recompute-activations", "--recompute-method", "uniform", "--recompute-num-layers", "2"],
     ["selective", "--recompute-method block"]),
    (["--recompute-activations", "--recompute-method", "block"], ["--recompute-num-layers N", "give both"]),
    (["--recompute-modules", "core_attn"], ["--recompute-modules", "--recompute-granularity selective"]),
    (FULL + ["--recompute-modules", "core_attn"], ["--recompute-modules", "selective"]),
    (["--recompute-activations", "--recompute-modules", "moe_act"],
     ["--recompute-modules moe_act", "mixture-of-experts", "core_attn layernorm mlp_act mlp"]),
    (["--recompute-activations", "--recompute-modules", "mla_up_proj"], ["multi-latent attention"]),
    (["--recompute-activations", "--recompute-modules", "attn"], ["--recompute-modules attn", "core_attn"]),
    (FULL + ["--recompute-method", "block", "--recompute-num-layers", "3"],
     ["--recompute-num-layers (3)", "--num-layers (2)"]),
    (["--recompute-activations", "--distribute-checkpointed-activations"],
     ["--distribute-checkpointed-activations", "full recompute"]),
    (["--recompute-activations", "--recompute-modules", "layernorm", "--apply-residual-connection-post-layernorm"],
     ["layernorm", "--apply-residual-connection-post-layernorm"]),
])
def test_contradictions_are_refused_naming_the_flags(flags, words):
    message = refusal(flags)
    assert "\n" not in message and all(word in message for word in words), message


def test_method_and_modules_take_only_their_choices():
    with pytest.raises(ArgumentError) as info:
        parse(["--recompute-method", "chunks"])
    assert "--recompute-method" in str(info.value)


def test_distributed_activations_keep_working_with_full_recompute():
    config = build_config(parse(FULL + ["--recompute-method", "block", "--distribute-checkpointed-activations"]),
                          tokenizer_vocab_size=1000).model
    assert config.distribute_checkpointed_activations and config.recompute_method == "block"


@pytest.mark.distributed
def test_a_contradiction_stops_pretrain_before_any_process_group(e2e_data):
    result = run_pretrain(tiny_gpt_flags(e2e_data) + ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
                                                      "--checkpoint-activations", "--recompute-activations"],
                          nproc=2, timeout=60)
    assert result.returncode == 2
    assert result.output.splitlines()[-1] == ("pretrain_gpt.py: error: --checkpoint-activations (full recompute) "
                                              "contradicts --recompute-activations: keep one")
    assert "Traceback" not in result.output and "gloo" not in result.output


# ---- the TFLOPs field: hardware work of each mode ----------------------------------------------------

COMMON = dict(global_batch_size=8, seq_length=2048, num_layers=24, hidden_size=2048, padded_vocab_size=50304,
              glu=False, iteration_time=1.0, world_size=1)


def test_hardware_flops_count_what_each_mode_recomputes():
    config = tiny_config(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048,
                         max_position_embeddings=2048, padded_vocab_size=50304)
    none = throughput.megatron_deepspeed_tflops(checkpoint_activations=False, **COMMON)
    uniform = throughput.megatron_deepspeed_tflops(checkpoint_activations=True, **COMMON)
    assert uniform / none == pytest.approx(4 / 3)  # Megatron-DeepSpeed's figure, kept
    assert throughput.recomputed_fraction(config) == 0.0
    block = dataclasses.replace(config, checkpoint_activations=True, recompute_method="block", checkpoint_num_layers=6)
    assert throughput.recomputed_fraction(block) == 0.25
    assert throughput.recomputed_fraction(block, pipeline_model_parallel_size=2) == 0.5
    assert throughput.recomputed_fraction(dataclasses.replace(block, checkpoint_num_layers=24),
                                          pipeline_model_parallel_size=2) == 1.0
    elementwise = dataclasses.replace(config, recompute_modules=("layernorm", "mlp_act"))
    assert throughput.recomputed_fraction(elementwise) == 0.0
    # s = h: a layer's forward is 24h^2 + 4sh per token, of which attention is 4sh = 1/7
    core = dataclasses.replace(config, recompute_modules=("core_attn", "layernorm", "mlp_act"))
    assert throughput.recomputed_fraction(core) == pytest.approx(1 / 7)
    mlp = dataclasses.replace(config, recompute_modules=("mlp",))
    assert throughput.recomputed_fraction(mlp) == pytest.approx(16 / 28)
    core_in_6 = dataclasses.replace(core, recompute_method="block", checkpoint_num_layers=6)
    assert throughput.recomputed_fraction(core_in_6) == pytest.approx(1 / 7 / 4)
    assert throughput.recomputed_fraction(core_in_6, pipeline_model_parallel_size=2) == pytest.approx(1 / 7 / 2)
    with_block = throughput.megatron_deepspeed_tflops(checkpoint_activations=False, recomputed_fraction=0.25, **COMMON)
    layers = 24 * 8 * 2048 * 24 * 2048 ** 2 * (1 + 2048 / (6 * 2048))
    assert (with_block - none) * 1e12 == pytest.approx(0.25 * layers)


def test_model_tflops_do_not_depend_on_the_mode():
    config = tiny_config(num_layers=4, seq_length=128, max_position_embeddings=128)
    rates = [throughput.compute_throughput(dataclasses.replace(config, **mode), global_batch_size=8, seq_length=128,
                                           iteration_time=0.5, world_size=1, data_parallel_size=1)
             for mode in ({}, dict(recompute_modules=("core_attn",)),
                          dict(checkpoint_activations=True, recompute_method="block", checkpoint_num_layers=1),
                          dict(checkpoint_activations=True))]
    assert len({rate.model_tflops for rate in rates}) == 1
    assert rates[0].tflops < rates[1].tflops < rates[3].tflops and rates[0].tflops < rates[2].tflops < rates[3].tflops
