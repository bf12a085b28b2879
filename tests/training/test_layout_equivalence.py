"""Every parallel layout trains the same model: single process, DP=2 with ZeRO-1 and ZeRO-2, TP=2, PP=2
and TP=2 x PP=2, and TP=2 (pipeline engine and ZeRO-2's plain module, and with --tp-comm-overlap
through the fused collectives' CPU path) and TP=2 x PP=2 with --sequence-parallel give the same
losses and gradient norms, iteration by iteration, and all of them equal a plain single-process
PyTorch AdamW loop (reference_loop.py) on the same model and batches.

Set-up shared by the layouts: CPU, gloo, fp32, dropout 0, --use-cpu-initialization (every layout
draws the same full weights, then keeps its slice), the vocabulary padded to 1152 (tokenizer 1000)
whatever the TP degree, micro batch 1, global batch 4 (4, 2, 4, 4 and 4 micro batches per data-
parallel rank), 6 iterations with a warmup step at lr 0 then a cosine decay, weight decay 1.0 and
clipping at 1.0, which every step triggers (the gradient norms are about 1.2-1.8): so gradient
reduction over DP, TP and the pipeline's tied embedding, clipping and the optimizer step are all in
the losses from iteration 2 on. The weight decay is large so that the no-decay rule shows: decaying
biases and LayerNorm weights too, or not clipping, moves the losses by ~5e-5 relative, 5x the
tolerance (with --weight-decay 0.1 a wrong rule would move them by only 5e-6).

Values are read at full precision from TensorBoard (the log line rounds the gradient norm to 3
decimals). Tolerances: losses agree to 1e-5 relative: the layouts only reorder fp32 sums (partial
matmuls over TP, the DP average, ZeRO's flat partitions), which moves a loss of ~7 by a few ulps
(seen: <= 1e-7) and Adam's update over 5 steps keeps that far below 1e-5. Gradient norms agree to
1e-4 relative: each is a square root of a sum of ~3e5 squares taken per shard, per stage or per ZeRO
partition in a different order, and DeepSpeed sums per-tensor norms where torch takes the norm of
the norms; the worst case of that rounding is about sqrt(N)·eps ≈ 3e-5 (seen: ~1e-6).
"""
import pytest
import torch

from megatron.core.models.gpt import GPTModelConfig
from tests.training.e2e_utils import read_scalars, run_pretrain, tiny_gpt_flags
from tests.training.reference_loop import ReferenceSchedule, run_reference_loop, training_dataset

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

GLOBAL_BATCH, TRAIN_ITERS, SEQ_LENGTH, SEED, NUM_LAYERS = 4, 6, 64, 1234, 2
LR, MIN_LR, WARMUP_ITERS, DECAY_ITERS, WEIGHT_DECAY = 1e-3, 1e-4, 1, 8, 1.0
LOSS_RTOL, GRAD_NORM_RTOL = 1e-5, 1e-4
# More position rows than the sequence uses: rows 64-79 never get a gradient, so every layout must count
# at least (80 - 64) x 64 zeros, and the zeros of the plain loop: up to ZEROS_ATOL more or fewer, the
# gradient entries that a layout's order of fp32 sums happens to cancel to exactly 0 (seen: 1 in ~170k).
MAX_POSITIONS, HIDDEN, ZEROS_ATOL = 80, 64, 3
# name -> (processes, layout flags)
LAYOUTS = {
    "single": (1, []),
    "dp2-zero1": (2, ["--zero-stage", "1"]),
    "dp2-zero2": (2, ["--zero-stage", "2"]),
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "tp2-pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "tp2-sp-overlap": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap"]),
    "tp2-sp-zero2": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "2"]),
    "tp2-pp2-sp": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--sequence-parallel"]),
}


def common_flags(data, *, seq_length=SEQ_LENGTH, num_layers=NUM_LAYERS, global_batch=GLOBAL_BATCH,
                 train_iters=TRAIN_ITERS):
    """The equivalence runs' flags: fp32, dropout 0, CPU initialization, a fixed padded vocabulary."""
    return tiny_gpt_flags(data, seq_length=seq_length, split="100,0,0", num_layers=num_layers) + [
        "--micro-batch-size", "1", "--global-batch-size", str(global_batch), "--train-iters", str(train_iters),
        "--lr", str(LR), "--min-lr", str(MIN_LR), "--lr-warmup-iters", str(WARMUP_ITERS),
        "--lr-decay-iters", str(DECAY_ITERS), "--lr-decay-style", "cosine", "--weight-decay", str(WEIGHT_DECAY),
        "--clip-grad", "1.0", "--adam-beta2", "0.95", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--use-cpu-initialization", "--pad-vocab-size-to", "1152", "--seed", str(SEED),
        "--log-interval", "1", "--eval-iters", "0", "--log-num-zeros-in-grad",
        "--max-position-embeddings", str(MAX_POSITIONS)]


def series(scalars, tag, steps=tuple(range(1, TRAIN_ITERS + 1))):
    """The values of ``tag``, checking they were logged at exactly ``steps``."""
    logged = [step for step, _ in scalars[tag]]
    assert logged == list(steps), f"{tag}: steps {logged}, expected {list(steps)}"
    return [value for _, value in scalars[tag]]


@pytest.fixture(scope="module")
def layout_runs(e2e_data, tmp_path_factory):
    """name -> (losses, grad norms, learning rates, log lines, zeros of the gradient) of one pretrain_gpt.py
    run per layout."""
    runs = {}
    for name, (processes, flags) in LAYOUTS.items():
        tensorboard_dir = str(tmp_path_factory.mktemp(f"tb_{name}"))
        result = run_pretrain(common_flags(e2e_data) + flags + ["--tensorboard-dir", tensorboard_dir],
                              nproc=processes)
        result.assert_ok()
        scalars = read_scalars(tensorboard_dir)
        runs[name] = (series(scalars, "lm-loss-training/lm loss"), series(scalars, "grad-norm/grad-norm"),
                      series(scalars, "learning-rate/learning-rate"), result.log_lines(),
                      series(scalars, "num-zeros/num-zeros"))
    return runs


def assert_counters_of_every_iteration(lines, name: str, train_iters: int = TRAIN_ITERS,
                                       global_batch: int = GLOBAL_BATCH, seq_length: int = SEQ_LENGTH) -> None:
    """Iterations 1..train_iters each logged, with the samples, tokens and batch size of the schedule."""
    assert [line.iteration for line in lines] == list(range(1, train_iters + 1)), name
    assert [int(line.number("consumed samples")) for line in lines] == \
        [global_batch * i for i in range(1, train_iters + 1)], name
    assert [int(line.number("consumed tokens")) for line in lines] == \
        [global_batch * seq_length * i for i in range(1, train_iters + 1)], name
    assert {int(line.number("global batch size")) for line in lines} == {global_batch}, name


def test_each_layout_logs_every_iteration_with_the_same_counters(layout_runs):
    for name, (_, _, _, lines, _) in layout_runs.items():
        assert_counters_of_every_iteration(lines, name)


@pytest.mark.parametrize("name", [name for name in LAYOUTS if name != "single"])
def test_layout_matches_the_single_process_run(layout_runs, name):
    losses, grad_norms, rates, lines, zeros = layout_runs[name]
    single_losses, single_grad_norms, single_rates, _, single_zeros = layout_runs["single"]
    assert zeros == pytest.approx(single_zeros, abs=ZEROS_ATOL)
    assert losses == pytest.approx(single_losses, rel=LOSS_RTOL)
    assert grad_norms == pytest.approx(single_grad_norms, rel=GRAD_NORM_RTOL)
    assert rates == pytest.approx(single_rates, rel=1e-6)
    # The printed line carries the same numbers (interval of 1: the average is the iteration's loss).
    assert [line.number("lm loss") for line in lines] == pytest.approx(single_losses, rel=LOSS_RTOL)
    assert [line.number("num zeros") for line in lines] == zeros


def test_the_run_changes_the_loss(layout_runs):
    """Guard against a vacuous comparison: the model does learn, so equal losses mean equal training."""
    losses = layout_runs["single"][0]
    assert len(set(round(loss, 4) for loss in losses)) == TRAIN_ITERS
    assert max(layout_runs["single"][1]) > 1.0  # clipping at 1.0 is active


def test_single_process_matches_a_plain_pytorch_adamw_loop(layout_runs, e2e_data):
    model = GPTModelConfig(num_layers=NUM_LAYERS, hidden_size=64, num_attention_heads=4, padded_vocab_size=1152,
                           seq_length=SEQ_LENGTH, max_position_embeddings=MAX_POSITIONS, hidden_dropout=0.0,
                           attention_dropout=0.0, use_cpu_initialization=True, seed=SEED)
    schedule = ReferenceSchedule(batch_sizes=(GLOBAL_BATCH,) * TRAIN_ITERS, lr=LR, min_lr=MIN_LR,
                                 warmup_samples=WARMUP_ITERS * GLOBAL_BATCH, decay_samples=DECAY_ITERS * GLOBAL_BATCH,
                                 decay_style="cosine", weight_decay=WEIGHT_DECAY, adam_beta1=0.9, adam_beta2=0.95,
                                 adam_eps=1e-8, clip_grad=1.0)
    dataset = training_dataset(e2e_data.data_prefix, SEQ_LENGTH, SEED, TRAIN_ITERS * GLOBAL_BATCH, e2e_data.cache_dir)
    reference = run_reference_loop(model, dataset, schedule)
    losses, grad_norms, rates, _, zeros = layout_runs["single"]
    assert reference[0].learning_rate == 0.0  # the warmup's first step
    assert zeros == pytest.approx([step.num_zeros for step in reference], abs=ZEROS_ATOL)
    assert min(zeros) >= (MAX_POSITIONS - SEQ_LENGTH) * HIDDEN
    assert losses == pytest.approx([step.loss for step in reference], rel=LOSS_RTOL)
    assert grad_norms == pytest.approx([step.grad_norm for step in reference], rel=GRAD_NORM_RTOL)
    assert rates == pytest.approx([step.next_learning_rate for step in reference], rel=1e-6)


def test_bf16_sequence_parallel_keeps_the_replicated_parameters_equal_across_tp(e2e_data, tmp_path):
    """bf16 at ZeRO-1 (DeepSpeed's BF16_Optimizer, which sums the sequence-parallel gradients over TP
    once per step from its fp32 accumulators): after 6 steps the norms' weights and biases and the
    row-parallel biases, replicated on both TP ranks, are equal bit for bit (without the sum over TP
    each rank would step on its own half of the sequence's gradient), and the losses follow the single
    process's within bf16 rounding."""
    losses = {}
    for name, processes, flags in (("single", 1, []),
                                   ("tp2-sp", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                  "--save", str(tmp_path / "checkpoint"),
                                                  "--save-interval", str(TRAIN_ITERS)])):
        tensorboard_dir = str(tmp_path / f"tb_{name}")
        run_pretrain(common_flags(e2e_data) + ["--bf16", "--zero-stage", "1"] + flags
                     + ["--tensorboard-dir", tensorboard_dir], nproc=processes).assert_ok()
        losses[name] = series(read_scalars(tensorboard_dir), "lm-loss-training/lm loss")
    assert losses["tp2-sp"] == pytest.approx(losses["single"], rel=5e-3)
    final_norm_file = f"layer_{NUM_LAYERS + 4:02d}-model_00-model_states.pt"
    compared = []
    for rank0_file in sorted((tmp_path / "checkpoint" / f"global_step{TRAIN_ITERS}").glob("layer_*-model_00-*.pt")):
        rank0 = torch.load(rank0_file, map_location="cpu", weights_only=True)
        rank1 = torch.load(str(rank0_file).replace("-model_00-", "-model_01-"), map_location="cpu", weights_only=True)
        for key, tensor in rank0.items():
            if "layernorm" in key or key.endswith(("dense.bias", "dense_4h_to_h.bias")) \
                    or rank0_file.name == final_norm_file:
                assert torch.equal(tensor, rank1[key]), f"{rank0_file.name} {key} differs between the TP ranks"
                compared.append(key)
    assert len(compared) == NUM_LAYERS * (2 * 2 + 2) + 2, compared  # per layer 2 norms x 2 + 2 biases; final norm
