"""The log line parsed back field by field, the FLOP formulas against hand counts and torch's FLOP
counter on our GPT model, validation/memory/milestone lines, and the matmul peak."""
import math
import re
from datetime import datetime

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron.core.models.gpt.config import GPTModelConfig
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import single_rank_groups
from megatron.core import flops as core_flops
from megatron.training import matmul_peak, metrics, throughput
from megatron.training.metrics import LossAccumulator, TrainingLogFields, training_log_line

# ---------------------------------------------------------------------------------------- FLOPs


def reference_model_flops(b, s, n, h, v):
    """Model FLOPs of docs/architecture.md: 72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h))."""
    return 72 * b * s * n * h ** 2 * (1 + s / (6 * h) + v / (12 * n * h))


@pytest.mark.parametrize("b, s, n, h, v", [(8, 2048, 24, 2048, 50304), (8, 2048, 24, 1024, 50304),
                                           (3, 16, 2, 32, 64), (512, 2048, 70, 14336, 250880)])
def test_model_flops_reduce_to_design_formula_without_glu_at_4h(b, s, n, h, v):
    flops = core_flops.model_flops_per_iteration(global_batch_size=b, seq_length=s, num_layers=n, hidden_size=h,
                                              padded_vocab_size=v)
    assert flops == pytest.approx(reference_model_flops(b, s, n, h, v), rel=1e-12)


def matmul_flops_by_shape(b, s, n, h, v, f, p, glu, k=None):
    """2·m·k·n for each matmul of one forward pass, times 3 for forward + backward; k the width of the
    keys and of the values (p without grouped-query attention)."""
    tokens = b * s
    k = p if k is None else k
    per_layer = [
        (tokens, h, p + 2 * k),            # QKV projection
        (b * s, p, s),                     # scores: per head [s, hn] x [hn, s], summed over heads
        (b * s, s, p),                     # probabilities x values
        (tokens, p, h),                    # output projection
        (tokens, h, (2 if glu else 1) * f),  # MLP up (both GLU halves)
        (tokens, f, h),                    # MLP down
    ]
    forward = n * sum(2 * m * k * o for m, k, o in per_layer) + 2 * tokens * h * v  # + logits
    return 3 * forward


@pytest.mark.parametrize("f, p, glu, k", [(128, 32, False, None), (48, 40, True, None), (80, 32, False, None),
                                          (48, 32, True, 16), (80, 48, False, 12)])
def test_model_flops_general_formula_matches_a_count_by_shapes(f, p, glu, k):
    b, s, n, h, v = 3, 16, 2, 32, 64
    flops = core_flops.model_flops_per_iteration(global_batch_size=b, seq_length=s, num_layers=n, hidden_size=h,
                                              padded_vocab_size=v, ffn_hidden_size=f, projection_size=p, glu=glu,
                                              key_value_size=k)
    assert flops == matmul_flops_by_shape(b, s, n, h, v, f, p, glu, k)


# Llama-class: 4 heads over 2 key/value groups, SwiGLU, RMSNorm, rotary, untied output layer, no biases
LLAMA = dict(num_query_groups=2, glu_activation="swiglu", bias_gelu_fusion=False, normalization="RMSNorm",
             position_embedding_type="rotary", rotary_base=500000.0, untie_embeddings_and_output_weights=True,
             add_bias_linear=False)


@pytest.mark.parametrize("options", [{"glu_activation": None, "ffn_hidden_size": None},
                                     {"glu_activation": "swiglu", "ffn_hidden_size": 48, "bias_gelu_fusion": False},
                                     {"glu_activation": None, "ffn_hidden_size": 80},
                                     {**LLAMA, "ffn_hidden_size": 48}], ids=["gpt", "swiglu", "ffn", "llama"])
def test_model_flops_equal_torch_flop_counter_on_our_gpt_model(options):
    # The materialized attention runs the scores and the weighted sum as (b)bmm, which torch counts.
    config = GPTModelConfig(**{**dict(num_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=12,
                                      padded_vocab_size=64, seq_length=16, max_position_embeddings=16,
                                      hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                                      attention_impl="materialized"), **options})
    model = GPTModel(config, single_rank_groups())
    tokens = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(tokens, labels=tokens).backward()
    expected = core_flops.model_flops_per_iteration(
        global_batch_size=3, seq_length=16, num_layers=2, hidden_size=32, padded_vocab_size=64,
        ffn_hidden_size=config.ffn_hidden_size, projection_size=config.projection_size,
        glu=config.glu_activation is not None, key_value_size=config.key_value_size)
    assert counter.get_total_flops() == expected


def test_megatron_deepspeed_tflops_formula():
    # 24 · 3 · B·s·L·h² · (1 + s/(6h) + V/(16·L·h)) / (t · world · 1e12), by hand for a round case:
    # B=8, s=1024, L=4, h=1024, V=65536: 1 + 1/6 + 1 = 13/6.
    expected = 24 * 3 * 8 * 1024 * 4 * 1024 ** 2 * (13 / 6) / (2.0 * 4 * 1e12)
    common = dict(global_batch_size=8, seq_length=1024, num_layers=4, hidden_size=1024, padded_vocab_size=65536,
                  iteration_time=2.0, world_size=4)
    assert throughput.megatron_deepspeed_tflops(glu=False, checkpoint_activations=False, **common) == pytest.approx(expected)
    assert throughput.megatron_deepspeed_tflops(glu=True, checkpoint_activations=True, **common) == pytest.approx(
        expected * (32 / 24) * (4 / 3))


def test_model_tflops_and_mfu():
    tflops, mfu = throughput.model_tflops_and_mfu(8e15, iteration_time=2.0, world_size=4, peak_tflops=800.0)
    assert (tflops, mfu) == (pytest.approx(1000.0), pytest.approx(1.25))
    assert throughput.model_tflops_and_mfu(8e15, 2.0, 4, None)[1] is None


def test_compute_throughput_uses_the_model_config():
    config = GPTModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, padded_vocab_size=1024,
                            seq_length=128, max_position_embeddings=128, checkpoint_activations=True)
    result = throughput.compute_throughput(config, global_batch_size=32, seq_length=128, iteration_time=0.5,
                                        world_size=4, data_parallel_size=2, peak_tflops=0.5)
    assert result.samples_per_second == 64.0
    assert result.samples_per_second_per_replica == 32.0
    assert result.tokens_per_second == 64.0 * 128
    assert result.tokens_per_second_per_replica == 32.0 * 128
    assert result.tflops == pytest.approx(throughput.megatron_deepspeed_tflops(
        global_batch_size=32, seq_length=128, num_layers=4, hidden_size=256, padded_vocab_size=1024, glu=False,
        checkpoint_activations=True, iteration_time=0.5, world_size=4))
    model_flops = reference_model_flops(32, 128, 4, 256, 1024)  # recomputation earns no credit
    assert result.model_tflops == pytest.approx(model_flops / (0.5 * 4 * 1e12))
    assert result.mfu == pytest.approx(result.model_tflops / 0.5)


def test_compute_throughput_counts_grouped_query_attention_swiglu_and_the_untied_head():
    """The log line's model TFLOP/s: per layer and token 4hp + 4hk + 4sp + 6hf (k = g hn = 2 x 32 of p = 256,
    SwiGLU), + 2hV for the untied output layer (Megatron-LM's count)."""
    config = GPTModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, padded_vocab_size=1024,
                            seq_length=128, ffn_hidden_size=512, **LLAMA)
    result = throughput.compute_throughput(config, global_batch_size=32, seq_length=128, iteration_time=0.5,
                                           world_size=4, data_parallel_size=2, peak_tflops=0.5)
    h, k, s, f = 256, 64, 128, 512
    model_flops = 3 * 32 * 128 * (4 * (4 * h * h + 4 * h * k + 4 * s * h + 6 * h * f) + 2 * h * 1024)
    assert result.model_tflops == pytest.approx(model_flops / (0.5 * 4 * 1e12), rel=1e-12)
    assert result.model_tflops < throughput.compute_throughput(
        GPTModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, padded_vocab_size=1024, seq_length=128,
                       ffn_hidden_size=512, **{**LLAMA, "num_query_groups": 8}),
        global_batch_size=32, seq_length=128, iteration_time=0.5, world_size=4, data_parallel_size=2).model_tflops


def test_gigaflos_increment():
    assert throughput.gigaflos_no_embeddings(16, 2048, 0.35) == pytest.approx(6 * 16 * 2048 * 0.35)


def test_matmul_peak_is_none_on_cpu():
    assert matmul_peak.measure_matmul_peak_tflops("cpu") is None


@pytest.mark.gpu
def test_matmul_peak_on_gpu():
    peak = matmul_peak.measure_matmul_peak_tflops("cuda", size=2048, warmup=2, repeats=5, trials=2)
    assert 1.0 < peak < 10_000.0


# ---------------------------------------------------------------------------------------- the log line

LINE_PATTERN = re.compile(
    r"^ iteration +(?P<iteration>\d+)/ +(?P<train_iters>\d+) \|"
    r" consumed samples: +(?P<samples>\d+) \|"
    r" consumed tokens: +(?P<tokens>\d+) \|"
    r" elapsed time per iteration \(s\): (?P<time>\d+\.\d{2}) \|"
    r" learning rate: (?P<lr>\d\.\d{3}E[+-]\d{2}) \|"
    r" global batch size: +(?P<gbs>\d+) \|"
    r"(?P<losses>( [a-z ]+ loss: \d\.\d{6}E[+-]\d{2} \|)*)"
    r"( loss scale: (?P<loss_scale>\d+\.\d) \|)?"
    r"( grad norm: (?P<grad_norm>\d+\.\d{3}) \|)?"
    r"( num zeros: (?P<num_zeros>\d+\.\d) \|)?"
    r"( params norm: (?P<params_norm>\d+\.\d{3}) \|)?"
    r"( curriculum seqlen: +(?P<seqlen>\d+) \|)?"
    r" number of skipped iterations: +(?P<skipped>\d+) \|"
    r" number of nan iterations: +(?P<nan>\d+) \|"
    r" samples per second: (?P<sps>\d+\.\d{3}) \|"
    r" TFLOPs: (?P<tflops>\d+\.\d{2}) \|"
    r"( model TFLOP/s: (?P<model_tflops>\d+\.\d{2}) \|)?"
    r"( MFU: (?P<mfu>\d+\.\d{2})% \|)?$")

SHAPE = dict(global_batch_size=512, seq_length=2048, num_layers=24, hidden_size=2048, padded_vocab_size=50304)


def full_fields(**overrides):
    iteration_time = 1.25
    values = dict(
        iteration=1200, train_iters=300000, consumed_samples=614400, consumed_tokens=1258291200,
        elapsed_time_per_iteration=iteration_time, learning_rate=5.9e-05, global_batch_size=512,
        losses={"lm loss": 2.3456789}, loss_scale=4096.0, grad_norm=0.34567, num_zeros=0.0, params_norm=271.8281,
        curriculum_seqlen=1024, skipped_iterations=2, nan_iterations=1,
        samples_per_second=512 / iteration_time,
        tflops=throughput.megatron_deepspeed_tflops(glu=False, checkpoint_activations=True, iteration_time=iteration_time,
                                   world_size=64, **SHAPE),
        model_tflops=123.456, mfu=0.43219)
    values.update(overrides)
    return TrainingLogFields(**values)


def test_log_line_parses_back_field_by_field():
    line = training_log_line(full_fields())
    match = LINE_PATTERN.match(line)
    assert match, line
    assert int(match["iteration"]) == 1200 and int(match["train_iters"]) == 300000
    assert line.startswith(" iteration     1200/  300000 |")
    assert int(match["samples"]) == 614400 and int(match["tokens"]) == 1258291200
    assert float(match["time"]) == 1.25
    assert match["lr"] == "5.900E-05"
    assert int(match["gbs"]) == 512
    assert match["losses"] == " lm loss: 2.345679E+00 |"
    assert (match["loss_scale"], match["grad_norm"], match["num_zeros"]) == ("4096.0", "0.346", "0.0")
    assert (match["params_norm"], match["seqlen"]) == ("271.828", "1024")
    assert (int(match["skipped"]), int(match["nan"])) == (2, 1)
    assert float(match["sps"]) == pytest.approx(409.6)
    assert (match["model_tflops"], match["mfu"]) == ("123.46", "43.22")
    # TFLOPs recomputed from the logged time, with Megatron-DeepSpeed's formula and --checkpoint-activations.
    recomputed = throughput.megatron_deepspeed_tflops(glu=False, checkpoint_activations=True, iteration_time=float(match["time"]),
                                     world_size=64, **SHAPE)
    assert match["tflops"] == f"{recomputed:.2f}"


def test_log_line_exact_text_with_only_the_mandatory_fields():
    line = training_log_line(full_fields(loss_scale=None, params_norm=None, curriculum_seqlen=None,
                                         model_tflops=None, mfu=None, grad_norm=None, num_zeros=None,
                                         tflops=12.3456))
    assert line == (" iteration     1200/  300000 | consumed samples:       614400 | consumed tokens:   1258291200 |"
                    " elapsed time per iteration (s): 1.25 | learning rate: 5.900E-05 | global batch size:   512 |"
                    " lm loss: 2.345679E+00 | number of skipped iterations:   2 | number of nan iterations:   1 |"
                    " samples per second: 409.600 | TFLOPs: 12.35 |")


def test_log_line_optional_fields_follow_megatron_deepspeeds_rules():
    line = training_log_line(full_fields(loss_scale=None, params_norm=None, curriculum_seqlen=None, mfu=None,
                                         losses={"lm loss": 0.0}))
    assert "loss scale" not in line and "params norm" not in line and "curriculum seqlen" not in line
    assert "lm loss" not in line  # a zero average (every iteration skipped) is not printed
    assert "MFU" not in line and " model TFLOP/s: 123.46 |" in line
    assert LINE_PATTERN.match(line)


def test_loss_accumulator_counts_skipped_and_nan_iterations():
    accumulator = LossAccumulator()
    accumulator.add({"lm loss": 2.0}, skipped=False)
    accumulator.add({"lm loss": float("inf")}, skipped=True, nan=True)
    accumulator.add({"lm loss": 4.0}, skipped=False)
    accumulator.add({"lm loss": 3.0}, skipped=True)  # an fp16 overflow: skipped, not a NaN
    assert accumulator.averages() == {"lm loss": 3.0}
    assert (accumulator.advanced_iterations, accumulator.skipped_iterations, accumulator.nan_iterations) == (2, 2, 1)
    assert accumulator.total_iterations == 4
    accumulator.reset()
    assert accumulator.total_iterations == 0 and accumulator.averages() == {}


# ---------------------------------------------------------------------------------------- other lines


def test_validation_lines():
    dashes, line, closing = metrics.validation_log_lines("iteration 1000", {"lm loss": 2.5})
    assert line == (f"validation loss at iteration 1000 | lm loss value: 2.500000E+00 | "
                    f"lm loss PPL: {math.exp(2.5):.6E} | ")
    assert dashes == closing == "-" * (len(line) + 1)


def test_validation_lines_of_a_named_group_and_the_ppl_cap():
    _, line, _ = metrics.validation_log_lines(metrics.VALIDATION_END_PREFIX, {"lm loss": 25.0}, group_name="ARXIV")
    assert line == (f"ARXIV loss at the end of training for val data | lm loss value: 2.500000E+01 | "
                    f"lm loss PPL: {math.exp(20):.6E} | ")
    assert metrics.validation_prefix(7) == "iteration 7"
    assert metrics.TEST_END_PREFIX == "the end of training for test data"


def test_memory_line_on_cpu():
    line = metrics.memory_report_line(3, 10)
    match = re.fullmatch(r"\[Rank 3\] \(after 10 iterations\) memory \(MB\) \| max resident: (\d+\.\d+)", line)
    assert match and float(match[1]) > 10.0
    line = metrics.memory_report_line(3, 0, moment="after model, optimizer, and learning rate scheduler are built")
    assert line.startswith("[Rank 3] (after model, optimizer, and learning rate scheduler are built) memory (MB) | ")


@pytest.mark.gpu
def test_memory_line_on_gpu():
    torch.ones(1024, 1024, device="cuda")
    line = metrics.memory_report_line(0, 5, torch.device("cuda"))
    number = r"(\d+\.\d+(e[+-]\d+)?)"
    assert re.fullmatch(rf"\[Rank 0\] \(after 5 iterations\) memory \(MB\) \| allocated: {number} \| "
                        rf"max allocated: {number} \| reserved: {number} \| max reserved: {number}", line), line


def test_parameter_and_milestone_lines():
    assert metrics.parameter_count_lines(1.3, 1.2) == ["estimated model parameters: 1.3",
                                                       "estimated model parameters without embeddings: 1.2"]
    assert metrics.rank_parameter_line(1, 12, 0.123456, 0.1) == "[001-012] 0.1235B / 0.1000B"
    assert metrics.initialization_time_line(12.34567) == "time to initialize megatron (seconds): 12.346"
    assert metrics.datetime_line("after megatron is initialized", datetime(2022, 3, 11, 9, 5, 7)) == \
        "[after megatron is initialized] datetime: 2022-03-11 09:05:07 "
    assert metrics.train_iterations_line(21) == "setting training iterations to 21"
    assert metrics.PARAMETERS_HEADER_LINE == \
        "Number of parameters: [tensor rank - pipeline rank] w/ and w/o embeddings:"
    assert metrics.BUILDING_DATASETS_LINE == "> building train, validation, and test datasets ..."
    assert metrics.saving_checkpoint_line(100, "/ckpt") == "saving checkpoint at iteration     100 to /ckpt"
    assert metrics.saved_checkpoint_line(100, "/ckpt") == "  successfully saved checkpoint at iteration     100 to /ckpt"
    assert metrics.loaded_checkpoint_line("/ckpt", 100) == "  successfully loaded checkpoint from /ckpt at iteration 100"
    assert metrics.kill_switch_line("/tmp/kill") == "Detected kill switch at /tmp/kill. Exiting"
    assert metrics.exit_after_minutes_label(1190.5) == "exiting program after 1190.5 minutes"
    assert metrics.exit_at_iteration_label(20) == "exiting program at iteration 20"


@pytest.mark.parametrize("seconds, text", [(0, "0:00:00"), (59.4, "0:00:59"), (59.6, "0:01:00"),
                                           (3725.4, "1:02:05"), (90061, "25:01:01"), (-3, "0:00:00")])
def test_format_duration(seconds, text):
    assert metrics.format_duration(seconds) == text


def test_remaining_seconds_until_the_iteration_or_token_stop():
    # 100 - 40 = 60 iterations at 2 s; a token stop 25 iterations away (1000 tokens each, rounded up) comes first.
    assert metrics.remaining_seconds(40, 100, 40_000, None, 1000, 2.0) == 120.0
    assert metrics.remaining_seconds(40, 100, 40_000, 64_500, 1000, 2.0) == 50.0
    assert metrics.remaining_seconds(100, 100, 0, None, 1000, 2.0) == 0.0


def test_log_line_ends_with_the_eta():
    fields = TrainingLogFields(iteration=10, train_iters=20, consumed_samples=40, consumed_tokens=2560,
                               elapsed_time_per_iteration=1.5, learning_rate=1e-3, global_batch_size=4,
                               skipped_iterations=0, nan_iterations=0, samples_per_second=2.667, tflops=0.5,
                               eta_seconds=15.0)
    assert training_log_line(fields).endswith(" TFLOPs: 0.50 | ETA: 0:00:15 |")


def test_run_summary_lines():
    totals = metrics.RunTotals()
    for _ in range(4):
        totals.add_iteration(8, 8 * 128, 2e12)
    totals.seconds = 2.0
    lines = metrics.run_summary_lines(totals, 14, 112, 14_336, {"train lm loss": 2.5, "validation lm loss": 3.0},
                                      world_size=2, peak_tflops=4.0)
    assert lines[0] == " training summary | iterations: 14 (4 in this run) | consumed samples: 112 | consumed tokens: 14336 |"
    assert lines[1] == (" training summary | train lm loss: 2.500000E+00 | validation lm loss: 3.000000E+00 |"
                        f" validation lm loss PPL: {math.exp(3.0):.6E} |")
    # 8e12 FLOPs in 2 s on 2 GPUs = 2 TFLOP/s per GPU, half of the 4 TFLOP/s peak.
    assert lines[2] == (" training summary | iteration time in this run: 0:00:02 | samples per second: 16.000 |"
                        " tokens per second: 2048.0 | model TFLOP/s per GPU: 2 | MFU: 50.00% |")
