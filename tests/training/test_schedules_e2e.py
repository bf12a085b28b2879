"""Batch-size rampup and learning-rate schedules in real pretrain_gpt.py runs: the log's global batch
sizes, consumed samples and tokens, and learning rates equal tables computed by hand below (not with
the library's functions), and the losses show the engine really trained on those batches.
"""
import math

import pytest

from megatron.core.models.gpt import GPTModelConfig
from tests.training.e2e_utils import run_pretrain, tiny_gpt_flags
from tests.training.reference_loop import ReferenceSchedule, run_reference_loop, training_dataset

SEQ_LENGTH, SEED = 64, 1234

# ---------------------------------------------------------------------------------------------------------
# Run 1: --rampup-batch-size 2 2 16 --global-batch-size 8 --train-samples 40, 2 data-parallel processes,
# micro batch 1, --lr 1e-3 --min-lr 1e-4 --lr-warmup-samples 6 --lr-decay-samples 30, linear decay.
#
# Rampup (megatron/training/microbatches.py): (8 - 2) / 2 = 3 increments over 16 samples, one every 16/3 = 5.33 samples;
# with c the samples consumed before an iteration, gbs(c) = 2 + 2·floor(c / 5.33) while c <= 16, then 8:
#   it 1: c = 0  -> 2        it 4: c = 6  -> 2 + 2·floor(1.125) = 4      it 7: c = 20 > 16 -> 8
#   it 2: c = 2  -> 2        it 5: c = 10 -> 2 + 2·floor(1.875) = 4      it 8: c = 28      -> 8
#   it 3: c = 4  -> 2        it 6: c = 14 -> 2 + 2·floor(2.625) = 6      (it 9 would need 36 + 8 > 40)
# so 8 iterations, 36 samples (the last 4 of the 40 are dropped, as Megatron-DeepSpeed does), 64 tokens each.
#
# Learning rate printed after each step, at n = consumed samples (W = 6, D = 30):
#   n <= 6: 1e-3·n/6;  6 < n <= 30: 1e-4 + (1 - (n - 6)/24)·9e-4;  n > 30: 1e-4
#   n = 2: 3.333e-4   n = 4: 6.667e-4   n = 6: 1e-3   n = 10: 1e-4 + (20/24)·9e-4 = 8.5e-4
#   n = 14: 1e-4 + (16/24)·9e-4 = 7e-4   n = 20: 1e-4 + (10/24)·9e-4 = 4.75e-4
#   n = 28: 1e-4 + (2/24)·9e-4 = 1.75e-4   n = 36 > 30: 1e-4
# ---------------------------------------------------------------------------------------------------------
RAMPUP_BATCH_SIZES = (2, 2, 2, 4, 4, 6, 8, 8)
RAMPUP_CONSUMED_SAMPLES = (2, 4, 6, 10, 14, 20, 28, 36)
RAMPUP_CONSUMED_TOKENS = (128, 256, 384, 640, 896, 1280, 1792, 2304)
RAMPUP_LEARNING_RATES = ("3.333E-04", "6.667E-04", "1.000E-03", "8.500E-04", "7.000E-04", "4.750E-04",
                         "1.750E-04", "1.000E-04")

# ---------------------------------------------------------------------------------------------------------
# Run 2: one process, global batch 4 (256 tokens per iteration), --train-iters 10 but --train-tokens 1300,
# --lr-warmup-iters 2 (8 samples) then a linear decay over tokens: --lr-decay-tokens 2048, min 1e-4.
#
# The run stops at the first iteration whose consumed tokens reach 1300: 6 x 256 = 1536 (5 x 256 = 1280).
# The schedule sees, at step k, n = 4k samples and the tokens consumed BEFORE iteration k, t = 256(k - 1)
# (Megatron-DeepSpeed's lag). The warmup ends at step 2 (n = 8), where t = 256 becomes the start of the token decay:
#   k = 1: 1e-3·4/8 = 5e-4        k = 2: 1e-3·8/8 = 1e-3
#   k >= 3: 1e-4 + (1 - (t - 256)/(2048 - 256))·9e-4 with (t - 256)/1792 = (k - 2)/7:
#   k = 3: 1e-4 + (6/7)·9e-4 = 8.714e-4   k = 4: 1e-4 + (5/7)·9e-4 = 7.429e-4
#   k = 5: 1e-4 + (4/7)·9e-4 = 6.143e-4   k = 6: 1e-4 + (3/7)·9e-4 = 4.857e-4
# ---------------------------------------------------------------------------------------------------------
TOKENS_CONSUMED_SAMPLES = (4, 8, 12, 16, 20, 24)
TOKENS_CONSUMED_TOKENS = (256, 512, 768, 1024, 1280, 1536)
TOKENS_LEARNING_RATES = ("5.000E-04", "1.000E-03", "8.714E-04", "7.429E-04", "6.143E-04", "4.857E-04")


def equivalence_flags():
    """Flags that make the run comparable with reference_loop.py (fp32, no dropout, layout-free init)."""
    return ["--attention-dropout", "0", "--hidden-dropout", "0", "--use-cpu-initialization",
            "--pad-vocab-size-to", "1152", "--seed", str(SEED)]


@pytest.fixture(scope="module")
def rampup_run(e2e_data):
    flags = tiny_gpt_flags(e2e_data, seq_length=SEQ_LENGTH, split="100,0,0") + equivalence_flags() + [
        "--micro-batch-size", "1", "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "16",
        "--train-samples", "40", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-samples", "6",
        "--lr-decay-samples", "30", "--lr-decay-style", "linear", "--zero-stage", "1",
        "--log-interval", "1", "--eval-iters", "0"]
    result = run_pretrain(flags, nproc=2)
    result.assert_ok()
    return result


@pytest.fixture(scope="module")
def token_run(e2e_data):
    flags = tiny_gpt_flags(e2e_data, seq_length=SEQ_LENGTH) + [
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "10", "--train-tokens", "1300",
        "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--lr-decay-tokens", "2048",
        "--lr-decay-style", "linear", "--log-interval", "1", "--eval-iters", "0"]
    result = run_pretrain(flags, nproc=1)
    result.assert_ok()
    return result


@pytest.mark.distributed
def test_rampup_batch_sizes_counters_and_learning_rates_follow_the_hand_table(rampup_run):
    lines = rampup_run.log_lines()
    assert "setting training iterations to 8" in rampup_run.output
    assert [(line.iteration, line.train_iters) for line in lines] == [(i, 8) for i in range(1, 9)]
    assert tuple(int(line.number("global batch size")) for line in lines) == RAMPUP_BATCH_SIZES
    assert tuple(int(line.number("consumed samples")) for line in lines) == RAMPUP_CONSUMED_SAMPLES
    assert tuple(int(line.number("consumed tokens")) for line in lines) == RAMPUP_CONSUMED_TOKENS
    assert tuple(line.fields["learning rate"] for line in lines) == RAMPUP_LEARNING_RATES


@pytest.mark.distributed
def test_rampup_trains_on_the_ramped_batches(rampup_run, e2e_data):
    """The engine processed B_k samples at iteration k (4 micro batches per rank at the end, 1 at the start):
    its losses equal a plain loop over the same batches, which a wrong accumulation count would break."""
    model = GPTModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, padded_vocab_size=1152,
                           seq_length=SEQ_LENGTH, max_position_embeddings=SEQ_LENGTH, hidden_dropout=0.0,
                           attention_dropout=0.0, use_cpu_initialization=True, seed=SEED)
    schedule = ReferenceSchedule(batch_sizes=RAMPUP_BATCH_SIZES, lr=1e-3, min_lr=1e-4, warmup_samples=6,
                                 decay_samples=30, decay_style="linear", weight_decay=0.01, adam_beta1=0.9,
                                 adam_beta2=0.999, adam_eps=1e-8, clip_grad=1.0)
    reference = run_reference_loop(model, training_dataset(e2e_data.data_prefix, SEQ_LENGTH, SEED, 40,
                                                           e2e_data.cache_dir), schedule)
    logged = [line.number("lm loss") for line in rampup_run.log_lines()]
    # The log prints 7 significant digits; see test_layout_equivalence.py for the 1e-5 tolerance.
    assert logged == pytest.approx([step.loss for step in reference], rel=1e-5)
    assert [float(rate) for rate in RAMPUP_LEARNING_RATES] == \
        pytest.approx([step.next_learning_rate for step in reference], rel=1e-3)


def test_train_tokens_stops_the_run_and_the_lr_decays_over_tokens(token_run):
    lines = token_run.log_lines()
    assert [(line.iteration, line.train_iters) for line in lines] == [(i, 10) for i in range(1, 7)]
    assert tuple(int(line.number("consumed samples")) for line in lines) == TOKENS_CONSUMED_SAMPLES
    assert tuple(int(line.number("consumed tokens")) for line in lines) == TOKENS_CONSUMED_TOKENS
    assert tuple(line.fields["learning rate"] for line in lines) == TOKENS_LEARNING_RATES
    assert all(math.isfinite(line.number("lm loss")) for line in lines)
