"""tools/model_calculator.py: parameter counts against published models, a tensor-by-tensor count and a
built GPTModel (Llama-class options too: RMSNorm, grouped-query attention, SwiGLU, untied output layer,
no biases), memory and FLOPs against hand computations and megatron.core.flops, and the errors of bad
layouts."""
import json
import math
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from megatron.core.flops import model_flops_per_iteration
from megatron.core.models.gpt import GPTModel
from megatron.core.parallel_state import single_rank_groups
from tools.model_calculator import (CalculatorError, Layout, ModelShape, TrainingBudget, calculate, count_parameters,
                                    layers_per_stage, main, model_config, model_state_bytes, stage_activation_bytes)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT2_MEDIUM = ModelShape(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=1024,
                         make_vocab_size_divisible_by=1)
GPT3_175B = ModelShape(num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048,
                       make_vocab_size_divisible_by=1)
BLOOM_176B = ModelShape(num_layers=70, hidden_size=14336, num_attention_heads=112, seq_length=2048,
                        vocab_size=250880, position_embedding_type="alibi", embed_layernorm=True)
# A model small enough to count by hand: V_p = 1000 at TP 1 (a multiple of 8), 1008 at TP 2 (of 16).
SMALL = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000,
                   make_vocab_size_divisible_by=8)
# Llama-class: 4 heads over 2 key/value groups (k = 32), SwiGLU with the default f = 8h/3 -> 128, RMSNorm,
# rotary, untied, no biases
LLAMA = replace(SMALL, normalization="RMSNorm", num_query_groups=2, swiglu=True, add_bias_linear=False,
                untie_embeddings_and_output_weights=True, position_embedding_type="rope", rotary_base=500000.0)
LLAMA_FLAGS = ["--normalization", "RMSNorm", "--group-query-attention", "--num-query-groups", "2", "--swiglu",
               "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
               "--rotary-base", "500000"]


def gpt_tensors(shape: ModelShape, vocab: int):
    """(name, shape, TP split dimension or None, owner) of every tensor of the GPT, written out as the
    layers hold them; owner is "embedding", "layer" or "head". Independent of the tool's formulas."""
    h, f, k = shape.hidden_size, shape.ffn, shape.key_value_size
    gate = 2 if shape.swiglu else 1
    yield "word_embeddings.weight", (vocab, h), 0, "embedding"
    if shape.position_rows:
        yield "position_embeddings.weight", (shape.position_rows, h), None, "embedding"
    if shape.embed_layernorm:
        yield "embed_layernorm.weight", (h,), None, "embedding"
        yield "embed_layernorm.bias", (h,), None, "embedding"
    layer = [("input_layernorm.weight", (h,), None), ("input_layernorm.bias", (h,), None),
             ("query_key_value.weight", (h + 2 * k, h), 0), ("query_key_value.bias", (h + 2 * k,), 0),
             ("dense.weight", (h, h), 1), ("dense.bias", (h,), None),
             ("post_attention_layernorm.weight", (h,), None), ("post_attention_layernorm.bias", (h,), None),
             ("dense_h_to_4h.weight", (gate * f, h), 0), ("dense_h_to_4h.bias", (gate * f,), 0),
             ("dense_4h_to_h.weight", (h, f), 1), ("dense_4h_to_h.bias", (h,), None)]
    rms = shape.normalization == "RMSNorm"
    for number in range(shape.num_layers):
        for name, dims, split in layer:
            kept = not (rms and "layernorm.bias" in name) and (
                shape.add_bias_linear or not name.endswith(".bias") or "layernorm" in name
                or shape.add_qkv_bias and name.startswith("query_key_value"))
            if kept:
                yield f"layers.{number}.{name}", dims, split, "layer"
    yield "final_layernorm.weight", (h,), None, "head"
    if not rms:
        yield "final_layernorm.bias", (h,), None, "head"
    if shape.untie_embeddings_and_output_weights:
        yield "output_layer.weight", (vocab, h), 0, "head"


def tensor_count(dims, split, tensor_parallel=1):
    count = math.prod(dims)
    return count // tensor_parallel if split is not None else count


def test_gpt2_medium_matches_the_published_count():
    counts = count_parameters(GPT2_MEDIUM)
    assert counts.total == 354_823_168  # Hugging Face gpt2-medium (vocabulary 50257, unpadded)
    padded = count_parameters(ModelShape(num_layers=24, hidden_size=1024, num_attention_heads=16, seq_length=1024))
    assert padded.total == 354_823_168 + (50304 - 50257) * 1024  # padded to 50304, as the trainer runs it
    assert padded.total == pytest.approx(354_823_168, rel=0.01)
    assert counts.without_embeddings == counts.total - 50257 * 1024 - 1024 * 1024


def test_gpt3_175b_matches_the_published_count():
    counts = count_parameters(GPT3_175B)
    assert counts.total == pytest.approx(175e9, rel=0.01)
    assert round(counts.total / 1e8) == 1746
    assert counts.total == sum(math.prod(dims) for _, dims, _, _ in gpt_tensors(GPT3_175B, 50257))


def test_bloom_176b_matches_the_published_count():
    assert count_parameters(BLOOM_176B).total == 176_247_271_424  # the BLOOM model card


@pytest.mark.parametrize("shape", [SMALL, ModelShape(num_layers=3, hidden_size=48, num_attention_heads=6,
                                                     seq_length=16, vocab_size=500, make_vocab_size_divisible_by=4,
                                                     ffn_hidden_size=96, untie_embeddings_and_output_weights=True,
                                                     embed_layernorm=True), LLAMA, replace(LLAMA, add_qkv_bias=True)])
def test_counts_per_gpu_match_the_split_tensors(shape):
    tp, pp = 2, 2
    multiple = shape.make_vocab_size_divisible_by * tp
    vocab = math.ceil(shape.vocab_size / multiple) * multiple
    counts = count_parameters(shape, tp, pp)
    tensors = list(gpt_tensors(shape, vocab))
    assert counts.total == sum(math.prod(dims) for _, dims, _, _ in tensors)
    per_layer = sum(tensor_count(dims, split, tp) for name, dims, split, _ in tensors if name.startswith("layers.0."))
    embedding = sum(tensor_count(dims, split, tp) for _, dims, split, owner in tensors if owner == "embedding")
    head = sum(tensor_count(dims, split, tp) for _, dims, split, owner in tensors if owner == "head")
    tied_copy = 0 if shape.untie_embeddings_and_output_weights else embedding  # DeepSpeed's tied module
    layers = [math.ceil(shape.num_layers / 2), shape.num_layers // 2]
    assert counts.per_gpu == [layers[0] * per_layer + embedding, layers[1] * per_layer + head + tied_copy]


def test_layers_per_stage():
    # DeepSpeed's partition_balanced over the trainer's layer list, weighting transformer layers 1, gave these.
    assert layers_per_stage(replace(SMALL, num_layers=10), 4) == [3, 3, 2, 2]
    assert layers_per_stage(replace(SMALL, num_layers=24), 5) == [5, 5, 5, 5, 4]
    assert layers_per_stage(replace(SMALL, num_layers=70), 12) == [6] * 10 + [5] * 2


def test_zero_stages_shrink_states():
    layout = Layout(num_gpus=8, tensor_parallel=2, precision="bf16", fp32_grad_accumulation=True)
    totals = [model_state_bytes(1_000_000, layout, zero).total for zero in range(4)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4
    alone = Layout(precision="bf16")
    assert len({model_state_bytes(1_000_000, alone, zero).total for zero in range(4)}) == 1  # DP 1: nothing to split


def test_memory_equals_a_hand_computation():
    layout = Layout(num_gpus=4, micro_batch_size=2, global_batch_size=16, zero_stage=2, precision="fp16")
    figures = calculate(SMALL, layout)
    parameters = 2 * (12 * 64 ** 2 + 13 * 64) + 1000 * 64 + 32 * 64 + 2 * 64  # layers, words, positions, final LN
    assert figures["parameters"]["per_gpu"] == [parameters]
    layer = 32 * 2 * 64 * (10 + 24)  # s b h (10 + 24/t) at t = 1
    logits = 2 * 2 * 32 * 2 * 1000  # fp16 logits and their gradient, 2 e s b V_p
    expected = {"weights": 2 * parameters, "gradients": 2 * parameters / 4, "optimizer": 12 * parameters / 4,
                "activations": 2 * layer + logits}  # DP 4, ZeRO 2; one micro-batch in flight without a pipeline
    expected["total"] = sum(expected.values())
    expected["host"] = 0.0
    assert figures["memory_per_gpu"]["stages"][0]["by_zero_stage"]["2"] == pytest.approx(expected, rel=1e-12)


def test_zero3_and_offload_by_hand():
    """ZeRO 3 partitions the weights too and gathers two modules at a time (the largest on SMALL: the
    word embedding, 1000 x 64 + the 32 x 64 positions) and keeps both small layers gathered from their
    forward to their backward (a layer of 49,984 is far under the reuse distance); optimizer offload
    moves Adam's 12 bytes and an fp32 gradient partition (4) per partitioned parameter to the host, at
    ZeRO 3 two of them (8; the GPU keeps no gradient partition but four 5e8-element
    reduce buckets), parameter offload the 2-byte weight partition."""
    layer = 12 * 64 ** 2 + 13 * 64
    parameters = 2 * layer + 1000 * 64 + 32 * 64 + 2 * 64
    gathered = 2 * (1000 * 64 + 32 * 64) + 2 * layer
    base = dict(num_gpus=4, micro_batch_size=2, global_batch_size=16, zero_stage=3, precision="fp16")
    plain = calculate(SMALL, Layout(**base))["memory_per_gpu"]["stages"][0]["by_zero_stage"]["3"]
    assert plain["weights"] == pytest.approx(2 * parameters / 4 + 2 * gathered)
    assert (plain["gradients"], plain["optimizer"], plain["host"]) == pytest.approx((2 * parameters / 4,
                                                                                     12 * parameters / 4, 0.0))
    offloaded = calculate(SMALL, Layout(**base, offload_optimizer=True, offload_param=True))
    states = offloaded["memory_per_gpu"]["stages"][0]["by_zero_stage"]["3"]
    assert (states["weights"], states["gradients"], states["optimizer"]) == pytest.approx((2 * gathered, 4 * 5e8 * 2, 0.0))
    assert states["host"] == pytest.approx((12 + 8 + 2) * parameters / 4)
    optimizer_only = calculate(SMALL, Layout(**{**base, "zero_stage": 1}, offload_optimizer=True))
    zero1 = optimizer_only["memory_per_gpu"]["stages"][0]["by_zero_stage"]["1"]
    assert (zero1["weights"], zero1["optimizer"], zero1["host"]) == pytest.approx(
        (2 * parameters, 0.0, 16 * parameters / 4))


def test_recompute_modes_and_ulysses_by_hand():
    """Per layer at e = 2, f = 4h, t = 1 the layer keeps s b h x 34 bytes; selective "layernorm mlp_act"
    frees the two norm outputs (4) and the GeLU output (8); block with N = 1 keeps the first layer's
    input (e s b h) and the second layer whole; Ulysses S = 2 halves the positions a GPU holds."""
    sbh = 32 * 2 * 64
    base = dict(micro_batch_size=2, precision="fp16")
    stages = {name: calculate(SMALL, Layout(**base, **changes))["memory_per_gpu"]["stages"][0]["activations"]
              for name, changes in {"none": {}, "selective": {"recompute_modules": ("layernorm", "mlp_act")},
                                    "block": {"checkpoint_activations": True, "recompute_method": "block"},
                                    "ulysses": {"ulysses": 2, "num_gpus": 2}}.items()}
    logits = 4 * 32 * 2 * 1000
    assert stages["none"]["per_micro_batch"] == 2 * sbh * 34
    assert stages["selective"]["per_micro_batch"] == 2 * sbh * (34 - 12)
    assert stages["block"]["per_micro_batch"] == 2 * sbh + sbh * 34 and stages["block"]["recompute"] == sbh * 34
    assert stages["ulysses"]["per_micro_batch"] == 2 * sbh * 34 / 2 and stages["ulysses"]["logits"] == logits / 2
    flops = {mode: calculate(SMALL, Layout(**base, **changes))["flops"]["this_run_hardware_flops_per_iteration"]
             for mode, changes in {"none": {}, "uniform": {"checkpoint_activations": True},
                                   "block": {"checkpoint_activations": True, "recompute_method": "block"}}.items()}
    layers = flops["uniform"] - flops["none"]  # one more forward of both layers
    assert flops["block"] - flops["none"] == pytest.approx(layers / 2)
    with_sp = calculate(SMALL, Layout(**base, ulysses=2, tensor_parallel=2, num_gpus=8, sequence_parallel=True,
                                      pipeline_parallel=2, global_batch_size=4))
    assert with_sp["layout"]["data_parallel"] == 1 and with_sp["layout"]["zero_partitions"] == 2
    with pytest.raises(CalculatorError, match="--ds-sequence-parallel-size 8 does not divide --num-attention-heads"):
        calculate(SMALL, Layout(**base, ulysses=8, num_gpus=8))


@pytest.mark.parametrize("changes, per_layer, logits", [
    ({}, 32 * 2 * 64 * 34, 4 * 32 * 2 * 1000),
    ({"tensor_parallel": 2, "num_gpus": 2}, 32 * 2 * 64 * (10 + 12), 4 * 32 * 2 * 1008 / 2),
    ({"materialized_attention": True}, 32 * 2 * 64 * 34 + 5 * 4 * 32 ** 2 * 2, 4 * 32 * 2 * 1000),
    ({"precision": "fp32"}, 32 * 2 * 64 * (4 * 4 + 2 + 4 * 4 + 8 * 4), 8 * 32 * 2 * 1000),
])
def test_activations_per_layer(changes, per_layer, logits):
    layout = Layout(**{"micro_batch_size": 2, "precision": "bf16", **changes})
    plain = stage_activation_bytes(SMALL, layout, 0, layers=2)
    assert (plain.per_micro_batch, plain.logits, plain.recompute) == pytest.approx((2 * per_layer, logits, 0))
    checkpointed = stage_activation_bytes(SMALL, replace(layout, checkpoint_activations=True), 0, layers=2)
    element = 4 if layout.precision == "fp32" else 2
    assert checkpointed.per_micro_batch == 2 * element * 32 * 2 * 64  # the input of each layer
    assert checkpointed.recompute == pytest.approx(per_layer)  # one layer rebuilt at a time
    assert checkpointed.total < plain.total


SBH = 32 * 2 * 64  # s b h of SMALL at micro batch 2


def test_selective_block_recompute_frees_in_the_first_n_layers_of_the_stage():
    layout = Layout(micro_batch_size=2, precision="bf16", recompute_modules=("mlp_act",))
    every_layer = stage_activation_bytes(SMALL, layout, 0, layers=2).per_micro_batch
    none = stage_activation_bytes(SMALL, replace(layout, recompute_modules=()), 0, layers=2).per_micro_batch
    assert none - every_layer == pytest.approx(2 * 2 * SBH * 4)  # e f / h per layer, f = 4h
    first = stage_activation_bytes(SMALL, replace(layout, recompute_method="block", checkpoint_num_layers=1), 0,
                                   layers=2).per_micro_batch
    assert first == pytest.approx((none + every_layer) / 2)


@pytest.mark.parametrize("changes, per_layer", [
    ({}, SBH / 2 * 34),  # s b h / t (34 + 5as/h), fused attention: no scores
    ({"materialized_attention": True}, SBH / 2 * 34 + 5 * 4 * 32 ** 2 * 2 / 2),
    ({"tp_comm_overlap": True}, SBH / 2 * 34 + 2 * 2 * (SBH - SBH / 2)),  # QKV and MLP inputs kept gathered
])
def test_sequence_parallel_activations(changes, per_layer):
    layout = Layout(**{"tensor_parallel": 2, "num_gpus": 2, "micro_batch_size": 2, "precision": "bf16",
                       "sequence_parallel": True, **changes})
    plain = stage_activation_bytes(SMALL, layout, 0, layers=2)
    assert plain.per_micro_batch == pytest.approx(2 * per_layer, rel=1e-12)
    assert plain.logits == pytest.approx(4 * 32 * 2 * 1008 / 2)  # the loss is not sequence-split
    checkpointed = stage_activation_bytes(SMALL, replace(layout, checkpoint_activations=True), 0, layers=2)
    assert checkpointed.per_micro_batch == 2 * 2 * SBH / 2  # each layer's input: the rank's block
    assert checkpointed.recompute == pytest.approx(per_layer, rel=1e-12)


def test_tp_comm_overlap_activations():
    # s b h / t (34 + 4 (t - 1)) at e = 2, f = 4h: the two gathered inputs at t = 4
    layout = Layout(tensor_parallel=4, num_gpus=4, micro_batch_size=2, precision="fp16", sequence_parallel=True,
                    tp_comm_overlap=True)
    per_layer = calculate(SMALL, layout)["memory_per_gpu"]["activation_bytes_per_layer"]
    assert per_layer == pytest.approx(SBH / 4 * (34 + 4 * 3), rel=1e-12)


def test_1f1b_micro_batches_in_flight():
    shape = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=1000)
    for global_batch, first_stage in ((8, 4), (2, 2)):
        layout = Layout(pipeline_parallel=4, num_gpus=4, global_batch_size=global_batch, precision="bf16")
        stages = calculate(shape, layout)["memory_per_gpu"]["stages"]
        assert [stage["activations"]["in_flight"] for stage in stages] == [first_stage, min(3, global_batch), 2, 1]
        assert [stage["activations"]["logits"] > 0 for stage in stages] == [False, False, False, True]


SMALL_PARAMETERS = 2 * (12 * 64 ** 2 + 13 * 64) + 1000 * 64 + 32 * 64 + 2 * 64  # P of SMALL at TP 1


@pytest.mark.parametrize("precision, fp32_accumulation, immediate, gradient_bytes", [
    ("bf16", True, True, 4),  # the fp32 accumulators only: each bf16 gradient is dropped once added
    ("bf16", True, False, 2 + 4),  # the bf16 gradients kept beside their accumulators
    ("bf16", False, True, 2),
    ("fp16", True, True, 2 + 4),  # immediate_grad_update is bf16's
    ("fp32", False, True, 4),
])
def test_immediate_grad_update_memory(precision, fp32_accumulation, immediate, gradient_bytes):
    layout = Layout(num_gpus=4, precision=precision, fp32_grad_accumulation=fp32_accumulation,
                    immediate_grad_update=immediate)
    assert model_state_bytes(SMALL_PARAMETERS, layout, 0).gradients == gradient_bytes * SMALL_PARAMETERS
    assert model_state_bytes(SMALL_PARAMETERS, layout, 2).gradients == gradient_bytes * SMALL_PARAMETERS / 4


def test_flops_and_days_equal_the_closed_forms():
    layout = Layout(num_gpus=4, micro_batch_size=2, global_batch_size=16)
    flops = calculate(SMALL, layout, TrainingBudget(train_tokens=1e9, mfu=0.5, peak_tflops=100))["flops"]
    B, s, L, h, V = 16, 32, 2, 64, 1000
    model = 72 * B * s * L * h ** 2 * (1 + s / (6 * h) + V / (12 * L * h))  # three passes, logits once each
    hardware = 96 * B * s * L * h ** 2 * (1 + s / (6 * h) + V / (16 * L * h))  # Narayanan et al. 2021
    assert flops["model_flops_per_iteration"] == pytest.approx(model, rel=1e-12)
    assert flops["hardware_flops_per_iteration_with_recompute"] == pytest.approx(hardware, rel=1e-12)
    assert flops["this_run_hardware_flops_per_iteration"] == flops["model_flops_per_iteration"]
    days = 1e9 * (model / (B * s)) / (4 * 100e12 * 0.5) / 86400
    assert flops["training"]["days"] == pytest.approx(days, rel=1e-12)
    assert flops["training"]["iterations"] == math.ceil(1e9 / (B * s))


SMALL_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
               "--vocab-size", "1000", "--make-vocab-size-divisible-by", "8"]


@pytest.mark.parametrize("flags, named", [
    (["--num-attention-heads", "5"], "--num-attention-heads 5 does not divide --hidden-size 64"),
    (["--tensor-model-parallel-size", "3", "--num-gpus", "3"], "--tensor-model-parallel-size 3 does not divide"),
    (["--tensor-model-parallel-size", "2", "--num-gpus", "3"], "--num-gpus 3 is not a multiple"),
    (["--num-gpus", "4", "--micro-batch-size", "2", "--global-batch-size", "12"], "--global-batch-size 12"),
    (["--pipeline-model-parallel-size", "2", "--num-gpus", "2", "--zero-stage", "2"], "--zero-stage 2"),
    (["--mfu", "1.5"], "--mfu"),
    (["--fp16", "--grad-accum-dtype", "bf16"], "--grad-accum-dtype"),
    (["--tensor-model-parallel-size", "2", "--num-gpus", "2", "--tp-comm-overlap"],
     "--tp-comm-overlap pipelines the all-gathers and reduce-scatters of sequence parallelism with their GEMMs: "
     "add --sequence-parallel"),
    (["--seq-length", "30", "--tensor-model-parallel-size", "4", "--num-gpus", "4", "--sequence-parallel"],
     "--tensor-model-parallel-size 4 does not divide --seq-length 30: --sequence-parallel"),
    (["--pad-vocab-size-to", "1000", "--tensor-model-parallel-size", "16", "--num-attention-heads", "16",
      "--num-gpus", "16"], "the padded vocabulary size (--make-vocab-size-divisible-by, --pad-vocab-size-to)=1000 is "
                           "not divisible by --tensor-model-parallel-size=16"),
    (["--offload-param", "--zero-stage", "2"], "--offload-param moves ZeRO 3's weight partitions"),
    (["--offload-optimizer"], "--offload-optimizer runs ZeRO's optimizer partitions on the host"),
    (["--ds-sequence-parallel-size", "3", "--num-gpus", "3"], "--ds-sequence-parallel-size 3 does not divide"),
    (["--recompute-method", "block"], "--recompute-method and --recompute-num-layers choose the layers"),
    (["--checkpoint-activations", "--recompute-activations"], "--checkpoint-activations (full recompute) contradicts"),
])
def test_a_bad_flag_exits_2_naming_it(flags, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(SMALL_FLAGS + flags)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_a_bad_layout_raises_from_the_functions_too():
    with pytest.raises(CalculatorError, match="--tensor-model-parallel-size 8 does not divide --num-attention-heads"):
        calculate(SMALL, Layout(tensor_parallel=8, num_gpus=8))
    with pytest.raises(CalculatorError, match="--tp-comm-overlap .* add --sequence-parallel"):
        calculate(SMALL, Layout(tensor_parallel=2, num_gpus=2, tp_comm_overlap=True))


def test_sequence_parallel_off_at_tp_1(capsys):
    tp2 = ["--tensor-model-parallel-size", "2", "--num-gpus", "2", "--bf16"]
    plain = main(SMALL_FLAGS + tp2)
    assert not plain["layout"]["sequence_parallel"] and not plain["layout"]["tp_comm_overlap"]
    assert plain["memory_per_gpu"]["activation_bytes_per_layer"] == 32 * 64 * (10 + 12)  # s b h (10 + 24/t)
    assert "sequence parallel" not in capsys.readouterr().out
    overlapped = main(SMALL_FLAGS + tp2 + ["--sequence-parallel", "--tp-comm-overlap"])
    assert overlapped["memory_per_gpu"]["activation_bytes_per_layer"] == 32 * 64 * (34 + 4) / 2
    assert "sequence parallel with TP comm overlap" in capsys.readouterr().out
    alone = main(SMALL_FLAGS + ["--bf16", "--json"])
    ignored = main(SMALL_FLAGS + ["--bf16", "--json", "--sequence-parallel", "--tp-comm-overlap"])
    assert ignored == alone  # the trainer turns both off at TP 1


def test_bf16_fp32_accumulators(capsys):
    def gradients(*flags):
        figures = main(SMALL_FLAGS + ["--bf16", *flags])
        return figures["memory_per_gpu"]["stages"][0]["by_zero_stage"]["0"]["gradients"]

    assert gradients() == 4 * SMALL_PARAMETERS
    assert "fp32 gradient accumulation (immediate_grad_update)" in capsys.readouterr().out
    assert gradients("--no-immediate-grad-update") == 6 * SMALL_PARAMETERS
    assert gradients("--grad-accum-dtype", "bf16") == 2 * SMALL_PARAMETERS


def test_the_report_prints_the_figures(capsys):
    figures = main(["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
                    "--seq-length", "1024", "--make-vocab-size-divisible-by", "1", "--bf16", "--num-gpus", "8",
                    "--zero-stage", "1", "--train-tokens", "300e9"])
    out = capsys.readouterr().out
    assert "(354,823,168)" in out and "ZeRO 3" in out and "days" in out
    assert figures["layout"]["fp32_grad_accumulation"]  # the trainer's bf16 default
    assert figures["layout"]["data_parallel"] == 8


def test_cli_json():
    """BLOOM at TP 4, PP 12 from the command line: the model card's count, and stdout holds only the JSON
    (DeepSpeed, imported for the stage split, announces nothing there)."""
    argv = ["--num-layers", "70", "--hidden-size", "14336", "--num-attention-heads", "112", "--seq-length", "2048",
            "--vocab-size", "250880", "--position-embedding-type", "alibi", "--embed-layernorm",
            "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "12", "--num-gpus", "384",
            "--micro-batch-size", "2", "--global-batch-size", "2048", "--bf16", "--zero-stage", "1", "--json"]
    environment = {name: value for name, value in os.environ.items() if name != "DS_ACCELERATOR"}
    result = subprocess.run([sys.executable, os.path.join("tools", "model_calculator.py"), *argv],
                            cwd=REPO_ROOT, capture_output=True, text=True, check=True, env=environment)
    figures = json.loads(result.stdout)
    assert figures["parameters"]["total"] == 176_247_271_424
    assert figures["parameters"]["layers_per_stage"] == [6] * 10 + [5] * 2
    assert figures["layout"]["data_parallel"] == 8


def test_report_defaults_and_words(capsys):
    """--max-position-embeddings left out is the sequence length, in the JSON and the header; one of a
    thing is singular."""
    figures = main(["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "1", "--seq-length", "32",
                    "--checkpoint-activations", "--json"])
    assert figures["model"]["max_position_embeddings"] == 32 == figures["model"]["position_table_rows"]
    assert "null" not in json.dumps(figures["model"]).replace('"pad_vocab_size_to": null', "")
    capsys.readouterr()
    main(["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "1", "--seq-length", "32",
          "--max-position-embeddings", "48", "--position-embedding-type", "rotary", "--checkpoint-activations"])
    header = capsys.readouterr().out.splitlines()[:2]
    assert header[0].startswith("model:  1 layer, hidden 64, 1 head, ") and "rotary positions (max 48)" in header[0]
    assert header[1].startswith("layout: 1 GPU = TP 1 x PP 1 x DP 1; micro batch 1, global batch 1 (1 micro-batch "
                                "per step)") and "recomputation full, 1 layer per chunk" in header[1]


@pytest.mark.parametrize("shape", [SMALL, LLAMA, replace(LLAMA, add_qkv_bias=True, num_query_groups=1),
                                   replace(LLAMA, untie_embeddings_and_output_weights=False, ffn_hidden_size=96)])
def test_counts_equal_a_built_gpt_model(shape):
    """The total is the parameters of the trainer's plain GPTModel of the same configuration."""
    # CPU initialization needs no model-parallel RNG stream
    model = GPTModel(replace(model_config(shape, 1), use_cpu_initialization=True), single_rank_groups())
    counts = count_parameters(shape)
    assert counts.total == sum(p.numel() for p in model.parameters())
    output = 0 if model.output_layer is None else model.output_layer.weight.numel()
    assert counts.output_layer == output
    positions = model.embedding.position_embeddings
    tables = model.embedding.word_embeddings.weight.numel() + output + (0 if positions is None else positions.weight.numel())
    assert counts.without_embeddings == counts.total - tables


def test_llama_count_by_hand():
    h, k, f, V = 64, 32, 128, 1000
    layer = h * (h + 2 * k) + h * h + 2 * f * h + f * h + 2 * h  # QKV, output, SwiGLU's 2f x h, f x h, two RMSNorms
    assert count_parameters(LLAMA).total == 2 * layer + h + 2 * V * h  # final RMSNorm; word and output tables


def test_llama_flops_are_megatron_lms_count():
    """F = 3 B s [L (4h^2 + 4hk + 4sh + 6hf) + 2hV]: grouped keys and values (k = 32), SwiGLU (three
    h x f matmuls), the untied head; equal to megatron.core.flops, which the trainer's log line uses."""
    layout = Layout(num_gpus=4, micro_batch_size=2, global_batch_size=16)
    flops = calculate(LLAMA, layout)["flops"]
    B, s, L, h, k, f, V = 16, 32, 2, 64, 32, 128, 1000
    layer = 4 * h * h + 4 * h * k + 4 * s * h + 6 * h * f
    assert flops["model_flops_per_iteration"] == 3 * B * s * (L * layer + 2 * h * V)
    assert flops["model_flops_per_iteration"] == model_flops_per_iteration(
        global_batch_size=B, seq_length=s, num_layers=L, hidden_size=h, padded_vocab_size=V, ffn_hidden_size=f,
        glu=True, key_value_size=k)
    assert flops["hardware_flops_per_iteration_with_recompute"] == B * s * (4 * L * layer + 6 * h * V)


def test_llama_activations():
    """Inside the TP regions Q and the attention output are h wide, K and V k wide, SwiGLU keeps its 2f
    input and its f product: s b (4e + 2) h + s b e (2h + 2k + 3f)."""
    layout = Layout(micro_batch_size=2, precision="bf16")
    per_layer = calculate(LLAMA, layout)["memory_per_gpu"]["activation_bytes_per_layer"]
    assert per_layer == pytest.approx(32 * 2 * (10 * 64 + 2 * (2 * 64 + 2 * 32 + 3 * 128)), rel=1e-12)


def test_llama_flags(capsys):
    figures = main(SMALL_FLAGS + LLAMA_FLAGS + ["--tensor-model-parallel-size", "2", "--num-gpus", "2", "--json"])
    assert figures["parameters"]["total"] == count_parameters(LLAMA, 2).total
    assert (figures["model"]["num_query_groups"], figures["model"]["key_value_size"]) == (2, 32)
    assert figures["model"]["ffn_hidden_size"] == 128
    same = main(SMALL_FLAGS + ["--normalization", "rmsnorm", "--num-key-value-heads", "2", "--swiglu",
                               "--disable-bias-linear", "--untie-embeddings-and-output-weights",
                               "--use-rotary-position-embeddings", "--rope-theta", "500000",
                               "--tensor-model-parallel-size", "2", "--num-gpus", "2", "--json"])
    assert same["parameters"] == figures["parameters"] and same["flops"] == figures["flops"]
    capsys.readouterr()
    main(SMALL_FLAGS + LLAMA_FLAGS)
    assert ("4 heads over 2 key/value groups, ffn 128 SwiGLU" in capsys.readouterr().out.splitlines()[0])


@pytest.mark.parametrize("flags, named", [
    (["--tensor-model-parallel-size", "4", "--num-gpus", "4"], "--tensor-model-parallel-size 4 does not divide "
                                                               "--num-query-groups 2"),
    (["--num-query-groups", "3"], "--num-query-groups 3 does not divide --num-attention-heads 4"),
])
def test_a_bad_llama_flag_exits_2_naming_it(flags, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(SMALL_FLAGS + LLAMA_FLAGS + flags)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(SMALL_FLAGS + ["--group-query-attention"])
    assert "--group-query-attention and --num-query-groups G go together" in capsys.readouterr().err


def test_flops_partition_gives_the_untied_head_its_share():
    """Per token a layer costs 4h^2 + 4hk + 4sh + 6hf = 81920 FLOPs and the head 2hV_p = 163840 (V_p = 1280),
    two layers' worth: of 6 layers + head over 2 stages the flops split gives 4 and 2 + the head, the
    default split 3 and 3."""
    shape = replace(LLAMA, num_layers=6, vocab_size=1280, make_vocab_size_divisible_by=128)
    assert layers_per_stage(shape, 2) == [3, 3]
    assert layers_per_stage(shape, 2, "flops") == [4, 2]
    # by parameters the word embeddings of stage 0 weigh as much as the untied head (V_p h each)
    assert layers_per_stage(shape, 2, "parameters") == [3, 3]
    layout = Layout(pipeline_parallel=2, num_gpus=2, pp_partition_method="flops")
    assert calculate(shape, layout)["parameters"]["layers_per_stage"] == [4, 2]
    assert main(SMALL_FLAGS + LLAMA_FLAGS + ["--num-layers", "6", "--vocab-size", "1280", "--make-vocab-size-divisible-by",
                                             "128", "--pipeline-model-parallel-size", "2", "--num-gpus", "2",
                                             "--pp-partition-method", "flops", "--json"])[
        "parameters"]["layers_per_stage"] == [4, 2]
    with pytest.raises(CalculatorError, match="--pp-partition-method 'stages' is not supported"):
        layers_per_stage(shape, 2, "stages")


def test_zero3_keeps_the_layers_within_the_reuse_distance_gathered():
    """DeepSpeed keeps a layer's weights gathered when they come back within 1e9 gathered elements: with
    2 (L - 1 - i) P_layer elements between layer i's forward and its backward, floor(1e9 / (2 P_layer)) + 1
    layers, at most the stage's."""
    from tools.model_calculator_memory import zero3_gathered_parameters
    assert zero3_gathered_parameters(10, 201_000_000, 32) == 20 + 3 * 201_000_000
    assert zero3_gathered_parameters(10, 78_680_000, 32) == 20 + 7 * 78_680_000
    assert zero3_gathered_parameters(10, 1_000, 4) == 20 + 4 * 1_000
    assert zero3_gathered_parameters(10, 0, 0) == 20
